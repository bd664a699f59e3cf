"""Which FSDP unit each collective of a final (lowered) trace gathers or reduces.

``units_of_collectives(trace, plan) -> {collective output name: (Unit, CollectiveKind)}``

Every collective the pass inserts reads a buffer one of its own ops made (``pack_shards`` for an all-gather,
``pack_grads`` or ``add_accumulated_grads`` for a reduce-scatter), and those ops carry the unit's name: the
unit is read off the op that feeds the collective, under any executor list, fused or not. HSDP's all-reduce
reads the reduced shard its unit's reduce-scatter returned: it takes that reduce-scatter's unit. A collective
fed by anything else (another transform's) is left out.
"""

from __future__ import annotations

from thunder.core import utils

from fsdp_pass.plan.units import UnitPlan
from fsdp_pass.predicates import collective_kind, is_wait, unit_of_op


def units_of_collectives(trace, plan: UnitPlan) -> dict:
    """Output name of each collective in ``trace`` -> (its :class:`Unit`, its :class:`CollectiveKind`), for the
    ones found."""
    unit_named = plan.unit_named
    producers = utils.producers(trace)
    found = {}
    for bsym in trace.bound_symbols:
        kind = collective_kind(bsym)
        if kind is None:
            continue
        source = producers.get(bsym.flat_proxy_args[0], None)
        if source is not None and is_wait(source):  # a collective of what an earlier one returned
            unit = found.get(source.args[0].name, (None, None))[0]
        else:
            unit = unit_named.get(unit_of_op(source)) if source is not None else None
        if unit is not None:
            found[bsym.output.name] = (unit, kind)
    return found
