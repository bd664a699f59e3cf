"""Every decision a compile makes that could differ between ranks, made once, from values every rank agrees on.

A plan must be the same on every rank (ranks that plan differently issue different collectives: a hang on NCCL),
and what it decides from can differ between ranks: the device (its memory, a probe's timings) and the shape of the
batch each rank's step was traced for. So:

1. When the model is sharded, :func:`settle_planning_inputs`: the cost inputs and the memory budget that
   ``FSDP("auto")`` and the default units plan with (the user's, else the device's defaults), rank 0's on every rank
   (a collective where the group has peers).
2. At the model's first compile, every rank agrees on the step summary it plans from
   (:func:`~fsdp_pass.search.planned_from.agree_on_step`, a collective where the group has peers), and
   :func:`decided_options` makes the decisions from it: ``FSDP("auto")``'s units, resharding, prefetch depths and
   checkpointing (:func:`~fsdp_pass.search.auto_options.plan_auto`), or the default units
   (:func:`~fsdp_pass.search.default_units.units_for`). ZeRO-3's last unit is decided by
   :func:`~fsdp_pass.plan.plan_units.plan_units` from the same summary.
3. At a later compile (another input shape on one rank alone, where no collective is possible; ``no_sync``),
   ``first`` is the first compile's plan: its summary, its auto plan and its choice of units are taken as they are,
   without planning again and without asking the other ranks.

``decided_options`` returns the options the later stages read, as if the user had written them, and the decisions
with their reasons (for ``explain()``).
"""

from __future__ import annotations

from dataclasses import replace

from fsdp_pass.search.auto_options import agreed_settings, options_of_auto_plan, plan_auto
from fsdp_pass.search.default_units import options_with_units, settled_units, units_for
from fsdp_pass.plan.options import FSDPOptions
from fsdp_pass.plan.unit_policies import StepModelUnits
from fsdp_pass.search.planned_from import PlannedFrom


def settle_planning_inputs(options: FSDPOptions, device, group) -> FSDPOptions:
    """``options`` with the cost inputs and budget the planners read filled in from ``device`` (the user's first),
    rank 0's on every rank of ``group`` (collective, where the group has peers)."""
    if options.auto is not None:
        return replace(options, auto=agreed_settings(options.auto, device, group))
    if isinstance(options.unit_policy, StepModelUnits):
        return replace(options, unit_policy=settled_units(options.unit_policy, device, group))
    return options


def decided_options(planned_from: PlannedFrom, model, options: FSDPOptions, first=None):
    """``(options, auto plan or None, units choice or None)``: the decisions of ``options`` made from the step every
    rank plans from (``planned_from``), or, at a later compile, the first compile's (``first``: its ``UnitPlan``)."""
    if options.auto is not None:
        auto = first.auto if first is not None else plan_auto(planned_from.summary, model, options)
        return options_of_auto_plan(auto, options), auto, None
    if isinstance(options.unit_policy, StepModelUnits):
        choice = first.units_choice if first is not None else units_for(planned_from.summary, options)
        return options_with_units(options, choice), None, choice
    return options, None, None
