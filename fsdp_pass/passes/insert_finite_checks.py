"""Pass: ``FSDP(check_finite=True)``'s NaN/inf checks in a final trace (the ops: :mod:`fsdp_pass.ops.finite_checks`).

``insert_finite_checks(trace, phase, plan, group, key) -> trace`` runs on the final forward and backward traces,
after the schedule (stage 6 of :mod:`fsdp_pass.pipeline`). Each check goes right after the op whose results it
reads, so no later pass moves it away from them, and the fusion executor, which ran before, cannot take it into a
region: the checks read only tensors that the final trace holds at top level, under every executor list.

1. Forward, per unit: after its ``pack_shards``, a check of the packed shard (its parameters as this rank sends
   them: the gathered parameters are every rank's packed shard side by side, so each rank checking its own covers
   them all and says which rank's shard holds the NaN; an 8-bit gather has no packed shard: after its
   ``quantize_shard``, a check of the shards it quantized); after the last op that reads its gathered parameters (or a
   view of them), a check of that op's results (its output). ZeRO-3's second gather, in the backward, is not
   checked again. A unit whose gather is its shards themselves (one rank:
   :func:`~fsdp_pass.ops.unshard.gathers_nothing`) has its ``view_shards`` in place of both ops: its parameters,
   views of the shards, are checked right after it, and its output after the last op that reads them.
2. Backward, per unit: after ``pack_grads``, this rank's gradient before the reduce-scatter; after
   ``unpack_grad_shard``, the reduced gradient shards.
3. ``clear_finite_flags`` first in the forward (after the inputs are named); ``raise_if_nonfinite`` right before the
   return of the backward, or of the forward of a step without a backward (a forward that has one returns the
   tensors it saves for it beside its outputs; one that saves none decides at its end too, which costs a second
   all-reduce and changes no verdict).

The checks are numbered in the order they run; each op's header names its unit, its flag and what it reads.
"""

from __future__ import annotations

from thunder.core.proxies import TensorProxy
from thunder.core.pytree import tree_flatten
from thunder.core.trace import TraceProvenance, from_trace

from fsdp_pass.ops.finite_checks import (
    DESCRIPTION,
    GRADIENT,
    GRADIENT_SHARD,
    OUTPUT,
    PARAMETERS,
    FiniteCheck,
    add_checks,
    bound_check,
    bound_clear,
    bound_decision,
)
from fsdp_pass.plan.units import UnitPlan
from fsdp_pass.predicates import (
    is_bookkeeping,
    is_conversion,
    is_input_unpacking,
    is_pack_grads,
    is_pack_shards,
    is_quantize_shard,
    is_return,
    is_unit_op,
    is_unpack_gathered,
    is_unpack_grad_shard,
    is_view_like,
    is_view_shards,
    unit_of_op,
)


def _tensors(bsym) -> list:
    return [p for p in bsym.flat_proxy_outs if isinstance(p, TensorProxy)]


def _last_reader(bsyms, start: int, names: set[str]) -> int | None:
    """Index of the last op after ``start`` that computes with a tensor in ``names`` (views and casts of them count
    as the tensors themselves; ``del`` and the return do not read)."""
    names, last = set(names), None
    for i in range(start + 1, len(bsyms)):
        b = bsyms[i]
        if is_bookkeeping(b) or is_unit_op(b) or not any(p.name in names for p in b.flat_proxy_args):
            continue
        if is_view_like(b) or is_conversion(b):
            names.update(p.name for p in _tensors(b))
        else:
            last = i
    return last


def _planned_checks(bsyms, phase: str, units: frozenset[str]) -> list[tuple[int, str, str, list]]:
    """``(index of the op the check follows, unit, what, tensors)`` for every check of ``phase``, in trace order."""
    found = []
    for i, b in enumerate(bsyms):
        unit = unit_of_op(b) if is_unit_op(b) else None
        if unit not in units:
            continue
        if phase == "forward" and (is_pack_shards(b) or is_view_shards(b)):
            found.append((i, unit, PARAMETERS, _tensors(b)))
        if phase == "forward" and is_quantize_shard(b):  # the shards it read (its output is codes)
            found.append((i, unit, PARAMETERS, list(b.args[0])))
        if phase == "forward" and (is_unpack_gathered(b) or is_view_shards(b)):
            last = _last_reader(bsyms, i, {p.name for p in _tensors(b)})
            if last is not None and _tensors(bsyms[last]):
                found.append((last, unit, OUTPUT, _tensors(bsyms[last])))
        if phase == "backward" and is_pack_grads(b):
            found.append((i, unit, GRADIENT, _tensors(b)))
        elif phase == "backward" and is_unpack_grad_shard(b):
            found.append((i, unit, GRADIENT_SHARD, _tensors(b)))
    return sorted(found, key=lambda f: f[0])  # stable: two checks after one op keep the units' order


def _saves_for_backward(forward) -> bool:
    """Whether a final forward trace returns tensors saved for a backward, beside its outputs."""
    ret = next((b for b in reversed(forward.bound_symbols) if is_return(b)), None)
    return ret is not None and any(isinstance(p, TensorProxy) for p in tree_flatten(ret.args[1:])[0])


def _check_header(check: FiniteCheck, slot: int) -> str:
    return f"[fsdp] unit {check.unit!r} check finite (flag {slot}): {DESCRIPTION[check.what]}"


def insert_finite_checks(trace, phase: str, plan: UnitPlan, group, key: str):
    """``group``: every rank of the model (they decide together); ``key``: the compile's key (its flags)."""
    bsyms = trace.bound_symbols
    planned = _planned_checks(bsyms, phase, frozenset(plan.unit_named))
    checks = [FiniteCheck(unit, what, phase) for _, unit, what, _ in planned]
    first = add_checks(key, group, checks)
    after: dict[int, list] = {}
    for n, ((at, _, _, tensors), check) in enumerate(zip(planned, checks)):
        after.setdefault(at, []).append(bound_check(tensors, key, first + n, _check_header(check, first + n)))

    decides = phase == "backward" or not _saves_for_backward(trace)
    start = next((i for i, b in enumerate(bsyms) if not is_input_unpacking(b)), len(bsyms))
    new = from_trace(trace)
    for i, b in enumerate(bsyms):
        if phase == "forward" and i == start:
            new.bound_symbols.append(bound_clear(key, f"[fsdp] check finite: clear this step's flags ({key})"))
        if decides and is_return(b):
            new.bound_symbols.append(bound_decision(key, (
                f"[fsdp] check finite: this rank's flags of {key} to the host, one all-reduce over every rank; if "
                "any is set, every rank raises an FSDPError naming the first unit, what it checked and the rank")))
        new.bound_symbols.append(b)
        new.bound_symbols.extend(after.get(i, ()))
    new.set_provenance(TraceProvenance(f"fsdp_pass: check finite ({len(checks)} checks in the {phase})"))
    return new
