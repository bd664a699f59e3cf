"""Pass: an in-place op on a tensor the loss depends on computes from a copy of it, so its gradient is exact.

``copy_before_in_place(trace) -> trace``, on the functional forward trace, before Thunder's autodiff (stage 0 of
:mod:`fsdp_pass.pipeline`). It works around Thunder (0.2.6): an in-place op such as ``top /= top.sum(-1,
keepdim=True)`` is traced as its out-of-place op followed by ``copy_`` of the result into ``top``; the out-of-place
op's gradient rule saves ``top`` for the backward, and the ``copy_`` overwrites that very tensor before the backward
reads it. Plain ``thunder.jit`` then gives a gradient tens of percent off, silently (eager PyTorch saves the value
from before the write). Written out of place the same step is exact.

1. A tensor "carries gradient" when it is an input of the trace that requires grad, or an output of an op that
   reads one that does (the trace's proxies do not say it themselves at this stage).
2. Each op tagged in-place by Thunder (``OpTags.IN_PLACE``) that reads a tensor carrying gradient, and whose
   decomposition ends with ``copy_(result, target)``, becomes: ``clone(target)``, the decomposition's ops reading
   the clone instead of ``target``, then the same ``copy_`` into ``target``. The write still happens (views and
   inputs of ``target`` see it, as in eager); the backward reads the clone, which nothing overwrites.
3. Any other op, and an in-place op no gradient flows through, is left as it is.

The clone is labelled in the printed trace: here, and on the lowered forward by :func:`label_copies` (stage 7 of
:mod:`fsdp_pass.pipeline`: lowering drops the header). It costs one copy of the target, kept for the backward only
where the op's gradient needs it: what eager PyTorch keeps too.
"""

from __future__ import annotations

import thunder.torch as ltorch
from thunder.core import prims, utils
from thunder.core.proxies import TensorProxy, variableify
from thunder.core.trace import TraceProvenance, from_trace, tracectx

from fsdp_pass.predicates import is_clone, is_copy_into, is_in_place


def _header(target: str, op: str) -> str:
    return f"fsdp_pass: {target} copied for the backward of the in-place {op} that writes it"


def _tensors(proxies) -> list[TensorProxy]:
    return [p for p in proxies if isinstance(p, TensorProxy)]


def carrying_gradient(trace) -> set[str]:
    """Names of the trace's tensors that requires-grad inputs flow into (step 1)."""
    names = {p.name for p in _tensors(trace.args) if p.requires_grad}
    for bsym in trace.bound_symbols:
        if any(p.name in names or p.requires_grad for p in _tensors(bsym.flat_args)):
            names.update(p.name for p in _tensors(bsym.flat_outs))
    return names


def _written_target(bsym) -> TensorProxy | None:
    """The tensor an in-place op writes into: the destination of the ``copy_`` its decomposition ends with."""
    if not is_in_place(bsym) or not bsym.subsymbols or bsym.subsymbols[-1].sym is not prims.copy_:
        return None
    target = bsym.subsymbols[-1].args[1]
    return target if isinstance(target, TensorProxy) else None


def _from_a_copy(new, bsym, target: TensorProxy) -> None:
    """Append ``bsym``'s decomposition to ``new``, every op but the final ``copy_`` reading a clone of ``target``."""
    new.push_scope([])
    copied = ltorch.clone(target)
    (clone,) = new.pop_scope()
    new.bound_symbols.append(clone.from_bsym(header=_header(target.name, bsym.sym.name)))
    swap = {variableify(target): copied}
    new.bound_symbols.extend(sub.from_bsym_swap_proxies(swap) for sub in bsym.subsymbols[:-1])
    new.bound_symbols.append(bsym.subsymbols[-1])


def copy_before_in_place(trace) -> object:
    grad = carrying_gradient(trace)
    written = {id(b): (b, t) for b in trace.bound_symbols if (t := _written_target(b)) is not None
               and any(p.name in grad for p in _tensors(b.flat_args))}  # the ops to rewrite, and their targets
    if not written:
        return trace
    new = from_trace(trace)
    with tracectx(new):
        for bsym in trace.bound_symbols:
            if id(bsym) in written:
                _from_a_copy(new, bsym, written[id(bsym)][1])
            else:
                new.bound_symbols.append(bsym)
    names = ", ".join(sorted({b.sym.name for b, _ in written.values()}))
    new.set_provenance(TraceProvenance(f"fsdp_pass: in-place ops computed from a copy ({names})"))
    return new


def label_copies(trace) -> object:
    """The lowered forward with each of this pass's clones labelled again: a clone of a tensor that a later ``copy_``
    writes into, read by the op whose result that ``copy_`` writes (ops a fusion region took are not at top level)."""
    producers = utils.producers(trace)
    ours: dict[str, str] = {}  # clone's output -> the tensor it copies
    for write in filter(is_copy_into, trace.bound_symbols):
        value, target = write.args[0], write.args[1]
        op = producers.get(value, None)
        for arg in _tensors(op.flat_args if op is not None else ()):
            made = producers.get(arg, None)
            if made is not None and is_clone(made) and made.args[0].name == target.name:
                ours[arg.name] = target.name
    if not ours:
        return trace
    new = from_trace(trace)
    new.bound_symbols = [b.from_bsym(header=_header(ours[b.output.name], "op")) if is_clone(b) and b.output.name in ours
                         else b for b in trace.bound_symbols]
    new.set_provenance(TraceProvenance("fsdp_pass: label the copies made for in-place ops"))
    return new
