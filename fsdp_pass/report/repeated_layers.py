"""A dry run's shortcut: interpret five of a model's identical layers, copy the ops of one for the rest.

Most of a dry run's time is Thunder's interpreter walking the model's Python code, layer after layer (about 80 %
of Llama-2-7B's 32 layers, more for a Hugging Face model's layers, whose code does more); Thunder's transforms and
this project's passes after it take the rest. A stack of identical layers (an ``nn.ModuleList`` whose children have
the same class and the same parameter shapes) gives the same ops in every layer, only with that layer's parameters.
``traced_once_per_layer_stack(module)``, while inside, has ``thunder.jit`` interpret ``module`` with its layers
``0`` to ``3`` and ``N-1`` only (:data:`LEADING` and the last) and hands Thunder the traces of all ``N``:

1. the stack is cut to five layers under their own names (``model.layers.0`` .. ``.3``, ``.N-1``), so the
   interpreter's prologue unpacks those parameters by their real names;
2. in the computation trace, each top-level op is given the last layer it depends on (through its inputs); the
   *period* of a layer runs from its first op to the first op of the next layer (the next layer's norm, before
   its parameters are read, belongs to the period of the layer before: the period is what repeats). Layers 0 and
   1 are left out of the comparison: the interpreter names proxies after the model's variables where the name is
   free (``q``, ``k`` in layer 0; in a Hugging Face layer the rotary function's ``q`` and ``k`` in layer 1), the
   layers after them by its counter;
3. the period of layer 3 must be the period of layer 2 shifted: the same symbols and constants op for op, its
   own results where layer 2 has its own, layer 3's parameter where layer 2's, the same tensor where layer 2 reads
   one from before it (shared: rotary tables, masks), and layer 2's result where layer 2 reads one of layer 1's
   (carried: the residual stream); every name of layer 3 is layer 2's moved on by one stride of the counter.
   And every copied layer must pass the prologue's checks of the attributes layer 3 was traced with
   (:mod:`fsdp_pass.report.layer_attributes`: a layer's sliding window or attention type, its ``eps``).
   Anything else, and the shortcut is not taken: the model is interpreted whole;
4. layers ``4 .. N-2`` are copies of layer 3's period with the names the counter would have given them, their own
   parameters and what the period before them carries; the last layer and the head read the last copy's, and
   their names move on by the copies' strides (the counter too, for what later passes name);
5. the prologue unpacks and checks the new layers' parameters (copies of layer 3's lines), and both traces take
   the parameters in the interpreter's order (by qualified name, checked on the interpreted ones). The prologue
   checks the attributes of the interpreted layers only (step 3 checked the copies'): a dry run never runs it.

What follows (FSDP's passes, autodiff, lowering, explain) runs on the whole traces as after a full interpretation:
the printed plan and the printed traces are the same (``tests/test_dry_run_models.py`` compares them, on the zoo's
Llama and on a Hugging Face one).
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from contextlib import contextmanager

import thunder
from thunder.core.codeutils import SigInfo
from thunder.core.proxies import Proxy, TensorProxy, variableify
from thunder.core.trace import TraceCtx, from_trace, tracectx
from torch import nn

from fsdp_pass.predicates import is_return, is_shape_check, is_unpack_buffer, is_unpack_parameter, is_unpack_trivial
from fsdp_pass.report.layer_attributes import differing_attribute

LEADING = 4  # layers 0 .. LEADING-1 are interpreted (and the last); the last two of them are compared
MIN_LAYERS = LEADING + 2  # fewer, and there is nothing to copy


class Copied:
    """What :func:`traced_once_per_layer_stack` did: ``layers`` copied (0: the model was interpreted whole) of
    ``stack``'s ``of`` layers, from the ops of its layer ``source``; ``skipped``: why it interpreted them all
    although it found a stack ("": it did not, or found none)."""

    def __init__(self):
        self.layers, self.of, self.stack, self.source, self.skipped = 0, 0, "", "", ""

    def __str__(self) -> str:
        if self.skipped:
            return f"every layer of {self.stack} interpreted: they do not repeat ({self.skipped})"
        if not self.layers:
            return ""
        return (f"{self.layers} of {self.of} layers of {self.stack} copied from layer {self.source}'s ops "
                f"({self.of - self.layers} interpreted)")


class NotPeriodic(Exception):
    """The traced layers do not repeat op for op: interpret the whole model instead."""


def layer_stack(module: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The longest ``nn.ModuleList`` of ``module`` whose children have one class and the same parameter shapes, dtypes
    and flags, no hooks, and at least :data:`MIN_LAYERS` of them: (its qualified name, it); None if there is none."""
    best = None
    for name, m in module.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) < MIN_LAYERS or (best and len(m) <= len(best[1])):
            continue
        kinds = {(type(c), tuple((n, p.shape, p.dtype, p.requires_grad) for n, p in c.named_parameters())) for c in m}
        hooked = any(s._forward_hooks or s._forward_pre_hooks or s._backward_hooks for c in m for s in c.modules())
        if len(kinds) == 1 and not hooked and name:
            best = (name, m)
    return best


@contextmanager
def traced_once_per_layer_stack(module: nn.Module):
    """While inside, ``thunder_general_jit`` of ``module`` interprets five layers of its stack and returns the traces
    of all of them (see the module's docstring); with no stack, or layers that do not repeat, it interprets all.
    Yields a :class:`Copied` that says which it did once the compile is made."""
    found, copied = layer_stack(module), Copied()
    if found is None:
        yield copied
        return
    prefix, stack = found
    interpret = thunder.thunder_general_jit

    def general_jit(*args, **kwargs):
        full = stack._modules
        keys = list(full)
        stack._modules = OrderedDict((k, full[k]) for k in _interpreted(keys))
        try:
            results = interpret(*args, **kwargs)
        finally:
            stack._modules = full
        try:
            expanded = _expanded(results, f"{prefix}.", keys, full)
        except NotPeriodic as e:
            copied.stack, copied.skipped = prefix, str(e)
            return interpret(*args, **kwargs)
        copied.layers, copied.of, copied.stack = len(keys) - len(_interpreted(keys)), len(keys), prefix
        copied.source = keys[LEADING - 1]
        return expanded

    thunder.thunder_general_jit = general_jit
    try:
        yield copied
    finally:
        thunder.thunder_general_jit = interpret


def _interpreted(keys: list[str]) -> tuple[str, ...]:
    """The layers the interpreter walks: the first :data:`LEADING` and the last."""
    return (*keys[:LEADING], keys[-1])


def _layer_of(name: str, prefix: str, keys: list[str]) -> str | None:
    if not name.startswith(prefix):
        return None
    key = name[len(prefix) :].split(".", 1)[0]
    return key if key in keys else None


def _all_outputs(bsym) -> list:
    outs = [o for o in bsym.flat_outs if isinstance(o, Proxy)]
    for sub in bsym.subsymbols:
        outs += _all_outputs(sub)
    return outs


def _same_leaf(a, b) -> bool:
    if isinstance(a, Proxy) or isinstance(b, Proxy):
        return False
    return type(a) is type(b) and (a == b if not isinstance(a, float) or a == a else b != b)


def _pair(b0, b1, seen: dict, counts: list) -> None:
    """Walk two ops (and their subsymbols) side by side: ``seen`` maps layer 2's proxies to layer 3's."""
    if b0.sym.id != b1.sym.id or len(b0.subsymbols) != len(b1.subsymbols):
        raise NotPeriodic(f"{b0.sym.name} vs {b1.sym.name}")
    for leaves0, leaves1 in ((b0.flat_args, b1.flat_args), (b0.flat_outs, b1.flat_outs)):
        if len(leaves0) != len(leaves1):
            raise NotPeriodic(b0.sym.name)
        for x0, x1 in zip(leaves0, leaves1):
            if isinstance(x0, Proxy) and isinstance(x1, Proxy):
                if type(x0) is not type(x1) or (isinstance(x0, TensorProxy) and (
                        x0.shape != x1.shape or x0.dtype != x1.dtype or x0.requires_grad != x1.requires_grad)):
                    raise NotPeriodic(f"{x0} vs {x1}")
                if seen.setdefault(x0.name, x1.name) != x1.name:
                    raise NotPeriodic(f"{x0.name} read as {seen[x0.name]} and {x1.name}")
            elif not _same_leaf(x0, x1):
                raise NotPeriodic(f"{b0.sym.name}: {x0!r} vs {x1!r}")
    counts[0] += 1
    for s0, s1 in zip(b0.subsymbols, b1.subsymbols):
        _pair(s0, s1, seen, counts)


def _periods(computation, layer_of_proxy: dict) -> tuple[int, int, int]:
    """Where the ops that depend on the compared layers and the last begin (layers ``LEADING-2``, ``LEADING-1``, N-1)."""
    depends: dict[str, int] = {}
    starts = {}
    for i, b in enumerate(computation.bound_symbols):
        d = max((depends.get(p.name, layer_of_proxy.get(p.name, -1)) for p in b.flat_proxy_args), default=-1)
        for o in b.flat_proxy_outs:
            depends[o.name] = max(d, layer_of_proxy.get(o.name, -1))
        starts.setdefault(d, i)
    order = [starts.get(j) for j in range(LEADING + 1)]
    if None in order or order != sorted(set(order)):
        raise NotPeriodic("the layers' ops are not in order")
    return order[LEADING - 2], order[LEADING - 1], order[LEADING]


def _expanded(results, prefix: str, keys: list[str], layers: dict[str, nn.Module]):
    prologue, computation = results.prologue_trace, results.computation_trace
    differs = differing_attribute(prologue, layers, prefix, (keys[LEADING - 2], keys[LEADING - 1]), keys[LEADING:-1])
    if differs is not None:
        raise NotPeriodic(differs)
    kept = _interpreted(keys)
    name_of = {b.output.name: b.args[1] for b in prologue.bound_symbols if is_unpack_parameter(b)}
    layer_of_proxy = {p: kept.index(_layer_of(n, prefix, keys)) for p, n in name_of.items()
                      if _layer_of(n, prefix, keys) is not None}
    s0, s1, s2 = _periods(computation, layer_of_proxy)
    bsyms = computation.bound_symbols
    if s1 - s0 != s2 - s1:
        raise NotPeriodic("layers 1 and 2 differ in length")
    seen, counts = {}, [0]
    for b0, b1 in zip(bsyms[s0:s1], bsyms[s1:s2]):
        _pair(b0, b1, seen, counts)
    before = {p.name for p in computation.args} | {o.name for b in bsyms[:s0] for o in _all_outputs(b)}
    defined0 = {o.name for b in bsyms[s0:s1] for o in _all_outputs(b)} - before  # (an output may be an input)
    defined1 = {o.name for b in bsyms[s1:s2] for o in _all_outputs(b)} - before - defined0
    carried = {}  # layer 3 reads it from layer 2's period: its name there -> its counterpart in layer 3's
    for x0, x1 in seen.items():
        if x0 in defined0:
            if x1 not in defined1:
                raise NotPeriodic(f"{x0} -> {x1}")
        elif layer_of_proxy.get(x0) == LEADING - 2:
            a, b = (len(prefix) + len(keys[j]) for j in (LEADING - 2, LEADING - 1))
            if layer_of_proxy.get(x1) != LEADING - 1 or name_of[x0][a:] != name_of[x1][b:]:
                raise NotPeriodic(f"parameter {x0} -> {x1}")
        elif x1 in defined0:
            carried[x1] = seen[x1]
        elif x0 != x1:
            raise NotPeriodic(f"{x0} -> {x1}")
    suffix_reads = {p.name for b in bsyms[s2:] for p in b.flat_proxy_args}
    if suffix_reads & defined0:
        raise NotPeriodic("the last layer reads the first layer's results")
    return _assemble(results, prefix, keys, (s0, s1, s2), seen, defined0, defined1, carried, name_of, layer_of_proxy)


def _param_proxy(p, layer_name: str):
    return p.replace_name("t_" + layer_name.replace(".", "_"))


_NUMBERED = re.compile(r"^([a-z]+)(\d+)$")


def _numbered(name: str) -> tuple[str, int]:
    match = _NUMBERED.match(name)
    if match is None:
        raise NotPeriodic(f"{name} is not a numbered name")
    return match[1], int(match[2])


def _stride(seen: dict, defined0: set) -> int:
    """How far the interpreter's name counter moves per layer: each of layer 3's names is layer 2's plus it."""
    strides = set()
    for x0 in defined0:
        (p0, n0), (p1, n1) = _numbered(x0), _numbered(seen[x0])
        if p0 != p1:
            raise NotPeriodic(f"{x0} -> {seen[x0]}")
        strides.add(n1 - n0)
    if len(strides) != 1:
        raise NotPeriodic(f"layer 3's names are not layer 2's shifted by one number: {sorted(strides)[:4]}")
    return strides.pop()


def _shifted(proxy, by: int):
    prefix, n = _numbered(proxy.name)
    return proxy.replace_name(f"{prefix}{n + by}")


def _swapped(bsym, *swaps):
    """``bsym`` with each swap applied in turn (Thunder's swap follows chains within one map)."""
    for swap in swaps:
        bsym = bsym.from_bsym_swap_proxies(swap)
    return bsym


def _kept_names(computation, kept_ops) -> set[str]:
    """The names the kept ops use, and the interpreter's unnumbered ones; numbered names it used for what no op
    kept (temporaries) are free: the copies and the moved tail now hold those numbers, as after a full run."""
    names = {p.name for b in kept_ops for p in _all_outputs(b) + list(b.flat_proxy_args)}
    return names | {n for n in computation.names if not _NUMBERED.match(n)}


def _add_names(comp, added: list[str]) -> None:
    """Adds the copies' names to ``comp``'s; ``NotPeriodic`` where one is taken twice or already."""
    if len(set(added)) != len(added) or set(added) & comp.names:
        taken = set(a for a in added if added.count(a) > 1) | (set(added) & comp.names)
        raise NotPeriodic(f"a copied name is taken: {sorted(taken)[:5]}")
    comp.names.update(added)


def _assemble(results, prefix, keys, starts, seen, defined0, defined1, carried, name_of, layer_of_proxy):
    """The traces of all layers: layer 3's period copied for layers ``keys[LEADING:-1]``, every name the one the
    interpreter would have given (its counter moves by the same stride per layer), so even the traces print the same."""
    prologue, computation = results.prologue_trace, results.computation_trace
    s0, s1, s2 = starts
    bsyms = computation.bound_symbols
    stride, extra = _stride(seen, defined0), len(keys) - len(_interpreted(keys))
    model = keys[LEADING - 1]  # the layer whose period is copied
    params1 = [p for p, j in layer_of_proxy.items() if j == LEADING - 1]
    proxies = {}
    for b in bsyms:
        for p in _all_outputs(b) + list(b.flat_proxy_args):
            proxies.setdefault(p.name, p)
    copies, new_params, previous, fresh = [], {}, {}, []  # previous: the copied period's name -> the last copy's proxy
    with tracectx(TraceCtx()):  # new names are checked against the whole trace below
        for r, key in enumerate(keys[LEADING:-1], start=1):
            swap = {variableify(proxies[name]): _shifted(proxies[name], r * stride) for name in defined1}
            for name in params1:
                layer_name = prefix + key + name_of[name][len(prefix) + len(model):]
                new = _param_proxy(proxies[name], layer_name)
                new_params[new.name] = (new, layer_name, name)
                swap[variableify(proxies[name])] = new
            # what layer 3 reads from layer 2's period, the copy reads from the period before it: in a second swap
            carry = {variableify(proxies[in0]): previous.get(in1, proxies[in1]) for in0, in1 in carried.items()}
            copies += [_swapped(b, swap, carry) for b in bsyms[s1:s2]]
            previous = {name: swap[variableify(proxies[name])] for name in defined1}
            fresh += [p.name for p in previous.values()]
        # the last layer and the head: their own names moved on by the copies' names (through names of their own,
        # which nothing else has), then what they read of layer 3's period read of the last copy's
        earlier = {p.name for p in computation.args} | {o.name for b in bsyms[:s2] for o in _all_outputs(b)}
        own = {o.name: o for b in bsyms[s2:] for o in _all_outputs(b) if _NUMBERED.match(o.name) and o.name not in earlier}
        temporary = {variableify(p): p.replace_name(f"{n}_before_copies") for n, p in own.items()}
        final = {variableify(t): _shifted(own[n[: -len("_before_copies")]], extra * stride)
                 for t in temporary.values() for n in (t.name,)}
        last = {variableify(proxies[n]): p for n, p in previous.items()}
        tail = [_swapped(b, temporary, final, last) for b in bsyms[s2:]]
    buffers = {b.output.name: b.args[1] for b in prologue.bound_symbols if is_unpack_buffer(b)}
    args = _ordered_args(computation.args, [p for p, _, _ in new_params.values()], name_of | buffers | {
        n: layer_name for n, (_, layer_name, _) in new_params.items()})
    comp = from_trace(computation)
    comp.names = _kept_names(computation, bsyms[:s2])
    unpacks = {b.output.name: b for b in bsyms[:s0] if is_unpack_trivial(b)}
    head = [b for b in bsyms[:s0] if not is_unpack_trivial(b)]
    with tracectx(TraceCtx()):
        for p, _, like in new_params.values():
            copy = unpacks[like].from_bsym_swap_proxies({variableify(proxies[like]): p})
            unpacks[p.name] = copy.from_bsym(kwargs={**copy.kwargs, "name": p.name}) if "name" in copy.kwargs else copy
    comp.bound_symbols = [unpacks[p.name] for p in args] + head + bsyms[s0:s2] + copies + tail
    added = [p.name for p in args if p.name not in comp.names]
    added += fresh
    added += [final[variableify(temporary[variableify(p)])].name for p in own.values()]
    _add_names(comp, added)
    comp.name_ctr = computation.name_ctr + extra * stride  # later passes name what they add as after a full run
    comp.args = args
    comp._siginfo = _siginfo(computation, args)
    pro = _prologue(prologue, args, new_params)
    return type(results)(pro, comp, results.epilogue_trace, results.interpreter_log)


def _ordered_args(args, new, name_of) -> list:
    """The interpreter's order: inputs first, then the module's parameters and buffers by qualified name, each
    part a number (a layer, in numeric order) or a name (after the numbers, alphabetically), as Thunder sorts them
    (checked on the interpreted ones)."""
    inputs = [a for a in args if a.name not in name_of]
    tensors = [a for a in args if a.name in name_of]
    in_order = [a.name for a in args[: len(inputs)]] == [a.name for a in inputs]
    if [a.name for a in tensors] != [a.name for a in sorted(tensors, key=lambda a: _order(name_of[a.name]))] or not in_order:
        raise NotPeriodic("the interpreter's argument order is not the one assumed")
    return inputs + sorted(tensors + new, key=lambda a: _order(name_of[a.name]))


def _order(qualified_name: str) -> list:
    """The key Thunder sorts a module's tensors by: ``model.layers.10.mlp`` after ``model.layers.9.mlp``."""
    return [k for part in qualified_name.split(".") for k in ([int(part)] if part.isnumeric() else [math.inf, part])]


def _siginfo(trace, args):
    si = SigInfo(trace.siginfo().name)
    si.args = [(p.name, None) for p in args]
    return si


def _prologue(prologue, args, new_params):
    """The prologue with the new layers' parameters unpacked and checked (copies of layer 3's lines) and returned
    in the computation's order."""
    by_like: dict[str, list] = {}
    for p, layer_name, like in new_params.values():
        by_like.setdefault(like, []).append((p, layer_name))
    pro = from_trace(prologue)
    out = []
    with tracectx(pro):
        for b in prologue.bound_symbols:
            if is_return(b):
                inputs, rest = b.args[0][0], b.args[0][1:]
                b = b.from_bsym(args=((tuple(args), *rest),))
                if len(inputs) + len(new_params) != len(args):
                    raise NotPeriodic("the prologue returns more than the computation takes")
            out.append(b)
            first = b.flat_proxy_args[0].name if b.flat_proxy_args else None
            like = b.output.name if is_unpack_parameter(b) else first if is_shape_check(b) else None
            for p, layer_name in by_like.get(like, []) if like in by_like else []:
                src = b.output if is_unpack_parameter(b) else b.flat_proxy_args[0]
                copy = b.from_bsym_swap_proxies({variableify(src): p})
                if is_unpack_parameter(b):
                    copy = copy.from_bsym(args=(copy.args[0], layer_name))
                out.append(copy)
    pro.bound_symbols = out
    pro.names.update(p.name for p, _, _ in new_params.values())
    return pro
