"""What the forward computes after an op: the byte rule's input for ZeRO-3's last unit where the step model cannot
price the units (:func:`~fsdp_pass.plan.plan_units.keeps_last_unit`).

``compute_after(computation, index) -> (op names, bytes)``: the ops after op ``index`` that compute a floating-point
tensor, and the bytes of what they compute. ``bytes_after_last_read(computation, param_of_arg)``: those bytes after
each parameter's last read, for every parameter at once (one walk back over the trace): what the step summary keeps
(``StepSummary.after_last_read``), so that the rule reads the step every rank plans from, not this rank's trace.
"""

from __future__ import annotations

from fsdp_pass.plan.trace_arguments import first_and_last_use
from fsdp_pass.predicates import is_bookkeeping, is_float_tensor, is_torch_view, is_view_like


def _is_view(bsym) -> bool:
    return is_view_like(bsym) or is_torch_view(bsym)


def _computes(bsym) -> bool:
    """Computes a floating-point tensor: not a view, a re-layout, a shape query, an integer result or bookkeeping."""
    return not (is_bookkeeping(bsym) or _is_view(bsym)) and any(is_float_tensor(o) for o in bsym.flat_proxy_outs)


def result_bytes(bsym) -> int:
    """The bytes of the floating-point tensors ``bsym`` computes, counted over its decomposition's ops (a
    ``cross_entropy``'s log-probabilities and what it takes of them), views left out."""
    if bsym.subsymbols:
        return sum(result_bytes(s) for s in bsym.subsymbols)
    if is_bookkeeping(bsym) or _is_view(bsym):
        return 0
    return sum(o.numel * o.dtype.bytes for o in bsym.flat_proxy_outs if is_float_tensor(o))


def compute_after(computation, index: int) -> tuple[list[str], int]:
    """The ops of ``computation`` after op ``index`` that compute a floating-point tensor, by name in trace order,
    and the bytes of what they compute: what the backward differentiates before it reaches op ``index``, and about
    what its gradients take."""
    ops = [b for b in computation.bound_symbols[index + 1:] if _computes(b)]
    return [b.sym.name for b in ops], sum(result_bytes(b) for b in ops)


def bytes_after_last_read(computation, param_of_arg: dict[str, str]) -> tuple[tuple[str, int], ...]:
    """(parameter name, :func:`compute_after`'s bytes after its last read) for each parameter the trace reads."""
    bsyms = computation.bound_symbols
    after = [0] * (len(bsyms) + 1)  # after[i]: the bytes computed by the ops from i on
    for i in range(len(bsyms) - 1, -1, -1):
        after[i] = after[i + 1] + (result_bytes(bsyms[i]) if _computes(bsyms[i]) else 0)
    uses = first_and_last_use(computation, set(param_of_arg))
    return tuple(sorted((param_of_arg[a], after[last + 1]) for a, (_, last) in uses.items()))
