"""Values the trace being built already determines: the ops that made a proxy, run eagerly while tracing.

While ``thunder.jit`` interprets a model, some of the tensors the model computes depend on nothing but numbers
known while tracing (positions made by ``torch.arange(n)``), and others on one tensor the call was given (a
boolean padding mask made from an ``attention_mask`` argument). Both have values while tracing: the first the
same for every call the compiled function serves (its prologue checks the shapes those numbers come from), the
second this call's. A lookaside can then decide as eager code decides, on values, where the interpreter would
have to keep both outcomes open.

1. :func:`known_value`: the ops of the trace being built that made ``proxy`` (a chain back to factory ops and
   at most one argument of the call), copied into a trace of their own and run with torch: a
   :class:`KnownValue` with the value, the argument the chain reads (None: it reads none) and the replay as a
   function of that argument. Meta tensors have no values, so a chain on the meta device (a dry run) is
   replayed on the CPU; an argument on the meta device, or a chain that reads a number that is not a constant,
   a parameter, a buffer, two arguments or a random op, gives None: no value here.
2. :func:`hold_on_every_call`: a decision made from a value that reads an argument holds for this call only, so
   the compiled function must not serve a call for which it would differ. It adds a check to the prologue
   (``fsdp_pass_decision_holds(attention_mask, 'transformers: ... #3', True)``, shown in the printed prologue)
   that replays the chain on the call's argument and raises where the decision differs: Thunder then tries the
   next cached compile, or traces anew, as it does for a new shape. Each decision so costs a compile per outcome
   (two at most) and, per call, the replay and the decision (on a GPU, one wait for the device: the eager
   decision waits for it too).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import thunder.executors.pythonex as pythonex
import torch
from thunder.common import transform_for_execution
from thunder.core import prims
from thunder.core.compile_data import get_cache_option
from thunder.core.devices import Device
from thunder.core.interpreter import PseudoInst, get_interpreterruntimectx
from thunder.core.jit_ext import get_jit_ctx
from thunder.core.codeutils import SigInfo
from thunder.core.options import CACHE_OPTIONS
from thunder.core.prims import OpTags
from thunder.core.proxies import NumberProxy, TensorProxy
from thunder.core.pytree import tree_map
from thunder.core.trace import from_trace, get_tracectx, tracectx
from thunder.executors.torchex import ex as torch_executor

_CALL_INPUTS = (PseudoInst.INPUT_ARGS, PseudoInst.INPUT_KWARGS)
_PASSED_THROUGH = (PseudoInst.BINARY_SUBSCR, PseudoInst.CONSTANT)  # an item of the call's args or kwargs


@dataclass(frozen=True)
class KnownValue:
    value: torch.Tensor
    argument: TensorProxy | None  # the call's argument the value is made from; None: made from numbers alone
    replay: Callable  # the argument's value -> the value (no argument: takes none)


def known_value(proxy: TensorProxy) -> KnownValue | None:
    """Step 1."""
    trace = get_tracectx()
    if trace is None or not isinstance(proxy, TensorProxy):
        return None
    chain = _chain(trace, proxy)
    if chain is None:
        return None
    ops, arguments = chain
    if len(arguments) > 1 or any(_random(op) for op in ops):
        return None
    argument = arguments[0] if arguments else None
    given = () if argument is None else (_value_of_argument(argument),)
    if given and (given[0] is None or given[0].is_meta):
        return None
    replay = _replayed(trace, ops, arguments, proxy, on_cpu=argument is None)
    try:
        value = replay(*given)
    except Exception:  # an op torch cannot run here: no value, transformers decides on its own
        return None
    return KnownValue(value, argument, replay)


_decisions: dict[str, Callable] = {}  # the prologue checks' decisions, by the key their checks print
_counter = itertools.count()


def hold_on_every_call(known: KnownValue, decide: Callable, outcome, what: str) -> bool:
    """Step 2: ``decide(value) == outcome`` is checked by the prologue on every later call when ``known`` reads an
    argument (``what`` names the decision in the printed prologue). False: it cannot be held (the cache option
    reuses compiles without running their prologues), and the caller must not use ``outcome``."""
    if known.argument is None:
        return True
    option = get_cache_option()
    if option is CACHE_OPTIONS.SAME_INPUT:
        return False
    if option is CACHE_OPTIONS.NO_CACHING:
        return True  # every call traces anew
    key = f"{what} #{next(_counter)}"
    _decisions[key] = lambda argument: decide(known.replay(argument))
    get_jit_ctx().add_constraint((decision_holds, known.argument, key, outcome))
    return True


class DecisionChanged(RuntimeError):
    """Raised by a prologue whose compile was made for another outcome: Thunder tries the next compile."""


def _decision_holds_meta(argument, key: str, outcome) -> None:
    return None


def _decision_holds(argument, key: str, outcome) -> None:
    if _decisions[key](argument) != outcome:
        raise DecisionChanged(f"{key}: this call's input decides otherwise than the one this compile was made for")


decision_holds = pythonex.ex.register_operator(
    "fsdp_pass_decision_holds", meta=_decision_holds_meta, fn=_decision_holds, tags=(OpTags.DONT_DCE,)
)


def _chain(trace, proxy: TensorProxy):
    """(the ops that made ``proxy``, in trace order; the call's tensor arguments they read), or None where they
    read anything else that is not made in the trace: a number, a parameter, a buffer."""
    producers = {out.name: bsym for scope in trace.scopes for bsym in scope for out in bsym.flat_proxy_outs}
    ops, arguments, todo = {}, {}, [proxy]
    while todo:
        p = todo.pop()
        bsym = producers.get(p.name)
        if bsym is None:
            if not (isinstance(p, TensorProxy) and _is_call_argument(p)):
                return None
            arguments[p.name] = p
        elif id(bsym) not in ops:
            ops[id(bsym)] = bsym
            todo.extend(a for a in bsym.flat_proxy_args if isinstance(a, (TensorProxy, NumberProxy)))
    order = {id(bsym): i for i, bsym in enumerate(b for scope in trace.scopes for b in scope)}
    return sorted(ops.values(), key=lambda b: order[id(b)]), list(arguments.values())


def _is_call_argument(proxy: TensorProxy) -> bool:
    """Whether ``proxy`` is a tensor the call was given (an item of its args or kwargs, at any depth), not a
    parameter, buffer or other attribute reached from the module."""
    record = proxy.history
    while record is not None and record.inst not in _CALL_INPUTS:
        if record.inst not in _PASSED_THROUGH or not record.inputs:
            return False
        record = record.inputs[0]
    return record is not None


def _value_of_argument(proxy: TensorProxy) -> torch.Tensor | None:
    """The tensor the call being traced passes where the trace has ``proxy``."""
    for wrapped in getattr(get_interpreterruntimectx(), "_proxied_values", ()):
        if wrapped.value is proxy:
            return wrapped.original_value
    return None


def _random(bsym) -> bool:
    return OpTags.RANDOM_OP in (bsym.sym.tags or ()) or any(_random(sub) for sub in bsym.subsymbols)


def _on_cpu(x):
    if isinstance(x, Device) and x.type == "meta":
        return Device("cpu")
    if isinstance(x, torch.device) and x.type == "meta":
        return torch.device("cpu")
    return x


def _itself(argument):
    return argument


def _replayed(trace, ops, arguments, proxy, *, on_cpu: bool) -> Callable:
    """``ops`` as a function of ``arguments`` returning ``proxy``'s value, run by torch (meta devices as the CPU
    where ``on_cpu``). No ops: ``proxy`` is the argument itself."""
    if not ops:
        return _itself
    replay = from_trace(trace)
    signature = SigInfo("replay")
    signature.args = [(a.name, None) for a in arguments]
    replay._siginfo, replay.args, replay.kwargs = signature, arguments, {}
    for bsym in ops:
        if on_cpu:
            bsym = bsym.from_bsym(args=tree_map(_on_cpu, bsym.args), kwargs=tree_map(_on_cpu, bsym.kwargs))
        replay.bound_symbols.append(bsym)
    with tracectx(replay):
        prims.python_return(proxy)
    executable = transform_for_execution(replay, (torch_executor, pythonex.ex), use_del_last_used=False)[-1]
    return executable.python_callable()

