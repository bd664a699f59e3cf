"""Pass: activation checkpointing per FSDP unit, recomputed from the gather the backward does anyway.

``checkpoint_units(trace, plan) -> trace`` (for the plan's units marked ``checkpointed``) runs on the
forward trace after :func:`~fsdp_pass.passes.insert_unshards.insert_unshards`:

1. A unit's *region* runs from its ``unshard_unit`` to the last op that reads one of the parameters it
   gathers (for a decoder layer: the layer's compute).
2. Every op of the region whose results are read only inside the region is tagged
   ``RECOMPUTE_IN_BACKWARD``. Thunder's autodiff then recomputes those results in the backward instead
   of saving them. What leaves the region (the layer's output, the residual stream) is not tagged, so
   it is saved as a checkpoint and the recomputation stops there. At the ``selective`` level
   (:mod:`~fsdp_pass.plan.checkpointing`) the region's matmuls and attentions are not tagged either: their
   results are saved, and only the cheap ops between them (norms, activation functions, casts) are
   recomputed, from them.
3. The recomputed ops read the unit's parameters where the backward has them: under ZeRO-3 the unit's
   ``unshard_unit`` is itself recomputed, so the one all-gather the backward issues for the unit feeds
   both the recomputation and the gradients. Under ZeRO-2 the gathered parameters are kept from the
   forward. Either way checkpointing adds no collective.
"""

from __future__ import annotations

from thunder.core import utils
from thunder.core.symbol import BoundSymbolTag
from thunder.core.trace import TraceProvenance, from_trace

from fsdp_pass.plan.checkpointing import SELECTIVE
from fsdp_pass.plan.units import UnitPlan
from fsdp_pass.predicates import is_bookkeeping, is_matmul, is_unshard_unit


def _reader_positions(trace):
    """A function: bound symbol -> the indices of the ops that read its results."""
    consumers = utils.consumers(trace)
    position = {id(b): i for i, b in enumerate(trace.bound_symbols)}
    return lambda bsym: [position[id(c)] for out in bsym.flat_proxy_outs for c in consumers.get(out, [])]


def checkpoint_units(trace, plan: UnitPlan) -> object:
    level_of = {u.name: u.checkpoint for u in plan.units if u.checkpointed}
    unit_names = frozenset(level_of)
    if not unit_names:
        return trace
    bsyms = trace.bound_symbols
    readers_of = _reader_positions(trace)
    # (index of the unshard_unit, index of the last reader of its outputs, level), per checkpointed unit
    regions = [
        (i, max(readers_of(b), default=i), level_of[b.args[2]])
        for i, b in enumerate(bsyms)
        if is_unshard_unit(b) and b.args[2] in unit_names  # unshard_unit(shards, group, unit_name, shapes)
    ]
    recompute: set[int] = set()
    for start, end, level in regions:
        for i in range(start + 1, end + 1):
            b = bsyms[i]
            if is_bookkeeping(b) or is_unshard_unit(b) or not b.flat_proxy_outs:
                continue
            if level == SELECTIVE and is_matmul(b):
                continue
            readers = readers_of(b)
            if readers and all(start < r <= end for r in readers):
                recompute.add(i)
    new = from_trace(trace)
    for i, b in enumerate(bsyms):
        if i in recompute:
            b = b.from_bsym()
            b.tags.add(BoundSymbolTag.RECOMPUTE_IN_BACKWARD)
        new.bound_symbols.append(b)
    selective = sum(level == SELECTIVE for level in level_of.values())
    how = f" ({selective} selective: their matmuls' and attentions' results kept)" if selective else ""
    new.set_provenance(TraceProvenance(f"fsdp_pass: checkpoint activations of {len(unit_names)} unit(s){how}"))
    return new
