"""The step model's price of any plan, hand-written or auto: ``price_plan(plan, options, cost) -> Prediction``.

``FSDP("auto")`` predicts its own plan's step time and peak; this prices the plan a user wrote (``Blocks``,
``BySize``, ``reshard_after_forward``, a ``Schedule``) with the same model, from the trace's summary every
compile keeps (``UnitPlan.summary``), so a hand-written plan and the auto plan can be set side by side, and
either against a measured step.

1. :func:`candidate_of` reads the plan as the step model's :class:`~fsdp_pass.cost.candidate_costs.Candidate`: each
   unit a run of consecutive pieces (:mod:`~fsdp_pass.cost.step_summary`), in forward order, with its
   resharding and its prefetch depth (``Schedule.prefetch``, ``prefetch_by_unit``), whether the shards are
   offloaded, and each unit's activation checkpointing level (``checkpoint_activations``).
2. :func:`~fsdp_pass.cost.step_model.predict` prices it with ``cost`` (a ``cost_model.DEFAULTS`` name,
   ``CostInputs``, or a probe's result; None: what an auto plan was made with, else the defaults of the device
   the step computes on), the optimizer being the one the summary was made for (AdamW unless
   ``FSDP("auto", optimizer=...)`` said otherwise).

A plan the model cannot describe is an FSDPError that says why: a unit that cuts a piece (per-parameter
units cut a layer's attention or MLP into its weights), or a schedule it does not follow (Thunder's own order,
a bound on unused gathered bytes, kept units not first).
HSDP's all-reduce across replicas is not priced: the shard group's collectives are.
"""

from __future__ import annotations

from fsdp_pass.errors import check
from fsdp_pass.cost.candidate_costs import Candidate
from fsdp_pass.cost.cost_model import CostInputs, device_defaults
from fsdp_pass.plan.options import FSDPOptions, resolve_cost
from fsdp_pass.cost.step_model import Prediction, predict
from fsdp_pass.cost.step_summary import StepSummary
from fsdp_pass.plan.units import Unit, UnitPlan

_PRICED = "The step model prices units made of whole pieces, prefetched by depth, stored or offloaded"


def _units_in_order(summary: StepSummary, plan: UnitPlan) -> list[tuple[int, Unit]]:
    """(first piece, unit) per unit, in forward order; an FSDPError where the units are not runs of pieces."""
    check(len(summary.pieces) > 0, "The step reads no parameters: there is nothing to price.",
          "Price the plan of a model whose forward reads its parameters.")
    piece_of = {p: i for i, piece in enumerate(summary.pieces) for p in piece.params}
    spans = []
    for unit in plan.units:
        pieces = sorted({piece_of[p] for p in unit.params if p in piece_of})
        cut = [summary.pieces[i].name for i in pieces if not set(summary.pieces[i].params) <= set(unit.params)]
        check(
            bool(pieces) and pieces == list(range(pieces[0], pieces[-1] + 1)) and not cut,
            f"Unit {unit.name} holds part of a piece of the step ({', '.join(cut) or 'pieces apart'}): the step "
            "model cannot price this plan.",
            f"{_PRICED}: units of whole blocks or of a block's children (Blocks, BySize, FSDP('auto')), "
            "not PerParameter.",
        )
        spans.append((pieces[0], pieces[-1], unit))
    spans.sort(key=lambda s: s[0])
    check(
        bool(spans) and spans[0][0] == 0 and spans[-1][1] == len(summary.pieces) - 1
        and all(a[1] + 1 == b[0] for a, b in zip(spans, spans[1:])),
        "The plan's units do not cover the step's pieces one after another: the step model cannot price it.",
        f"{_PRICED}: each unit a run of consecutive pieces in forward order.",
    )
    return [(first, unit) for first, _, unit in spans]


def candidate_of(summary: StepSummary, plan: UnitPlan, options: FSDPOptions) -> Candidate:
    """``plan`` (made with ``options``) as the step model's candidate over ``summary``'s pieces."""
    return _candidate(_units_in_order(summary, plan), options)


def _candidate(units: list[tuple[int, Unit]], options: FSDPOptions) -> Candidate:
    schedule = options.schedule
    check(
        schedule is not None and schedule.kept_units_first and schedule.max_unused_bytes is None,
        f"The plan's schedule ({schedule!r}) places gathers where the step model does not.",
        f"{_PRICED}: a Schedule with prefetch depths, kept_units_first=True and no max_unused_bytes.",
    )
    own = dict(schedule.prefetch_by_unit)
    depths = tuple(own.get(unit.name, schedule.prefetch) for _, unit in units)
    levels = tuple(unit.checkpoint for _, unit in units)
    return Candidate(
        tuple(first for first, _ in units),
        tuple(unit.reshard_after_forward for _, unit in units),
        schedule.prefetch,
        options.offload_to is not None,
        depths if any(d != schedule.prefetch for d in depths) else (),
        levels if any(unit.checkpointed for _, unit in units) else (),
    )


def cost_inputs(cost, device=None) -> CostInputs:
    """``cost`` as :class:`CostInputs` (read as ``FSDP("auto", cost=...)`` reads it), None being the defaults of
    ``device`` (``h100-nvlink`` on CUDA, ``cpu-gloo`` otherwise)."""
    return resolve_cost(cost) or device_defaults(device)[0]


def price_plan(plan: UnitPlan, options: FSDPOptions, cost=None, device=None) -> Prediction:
    """The step time and peak the step model predicts for ``plan``, compiled with ``options``."""
    check(
        plan.summary is not None,
        "This plan has no step summary: it was not made from a trace by a compile.",
        "Price the plan of a compiled step (fsdp_pass.predict_step(jitted_model) after its first step).",
    )
    summary = plan.summary
    units = _units_in_order(summary, plan)
    if cost is None and plan.auto is not None:
        cost = plan.auto.cost  # what the auto plan was made with
    return predict(summary, _candidate(units, options), cost_inputs(cost, device), [unit.name for _, unit in units])
