"""The auto planner: units, reshard-after-forward per unit, prefetch depth, activation checkpointing per unit and
offload, chosen to make the predicted step fastest within a memory budget, each decision with its reason.

``plan_step(summary, cost, budget) -> AutoPlan`` is a pure function of a
:class:`~fsdp_pass.cost.step_summary.StepSummary`, :class:`~fsdp_pass.cost.cost_model.CostInputs` and a budget
in bytes (None: no bound). Predictions come from :func:`~fsdp_pass.cost.step_model.predict`.

1. Offload stays off if any plan fits without it; prefetch depths 0, 1 and 2 are each planned, and the
   fastest plan that fits wins, but prefetch 0 only when no deeper prefetch fits: it is a memory measure.
   The model cannot see what it costs where the probe measures no overlap (gloo on shared CPU cores): there
   an exposed gather also waits for the slower rank, and the 22 MiB plan of the README ran 10 % slower
   at prefetch 0 than at 1 (64.5 against 58.5 ms per step on 2 ranks, the same units; docs/units-cost-schedule.md, "The auto plan").
2. For one prefetch depth, the units come from the greedy search over units (:mod:`~fsdp_pass.search.unit_search`,
   the default units' too): from one unit per block, each time the merge of two neighbouring units or the split
   of a unit at one of its pieces that shortens the predicted step most, until none does; moves that together
   shorten it by less than 2 % are given up for one unit per block, when that fits. A move that needs more
   memory than the budget gives is taken only with the resharding below.
3. For one set of units, keep every unit gathered from its forward to its backward (ZeRO-2, no second
   gather) unless the peak exceeds the budget; then reshard units (ZeRO-3 for them), as few as bring the
   peak within the budget: while searching, the largest first; for the plan chosen, each time the one that
   lowers the peak most, then back to kept each that the budget allows. The last unit the forward gathers
   is never resharded: the backward starts with it, so freeing it would only mean gathering it again.
4. For the plan chosen, give units a prefetch depth of their own (1 or 2; 0 too when the plan's is 0) one at
   a time, each change kept when it shortens the predicted step within the budget; a unit gathered later
   holds its bytes for less time, and that may let resharded units stay gathered (tried after each change).
5. Activation checkpointing (:mod:`~fsdp_pass.search.auto_checkpoint`) only when no plan fits without it, and
   before offload (which needs the user's ``offload_to``): for a set of units whose peak is over the budget
   with every unit resharded, units checkpoint their activations, selective before full, those that free most
   bytes per recompute second first, as few as fit; for the plan chosen, each unit's level is then stepped down
   wherever the budget allows, before units are kept gathered (step 3). The reasons name each checkpointed
   unit, what it keeps and what its backward recomputes.
6. No plan fits: an FSDPError naming the smallest budget one does (every piece its own unit, all resharded,
   no prefetch, every unit checkpointed, offload on when allowed).

Items 3-5 per unit: :mod:`~fsdp_pass.search.per_unit_decisions`; the plan as it prints, and each reason's
wording: :mod:`~fsdp_pass.search.auto_plan_text`.
"""

from __future__ import annotations

from dataclasses import replace

from fsdp_pass.errors import check, fail
from fsdp_pass.search.auto_checkpoint import checkpoint_reasons, moves, with_moves
from fsdp_pass.search.auto_plan_text import AutoPlan, depth_note, move_reason, reshard_reasons
from fsdp_pass.cost.candidate_costs import Candidate
from fsdp_pass.cost.cost_model import CostInputs
from fsdp_pass.search.per_unit_decisions import PREFETCH_DEPTHS, PerUnitDecisions
from fsdp_pass.cost.step_model import Prediction, ms, predict
from fsdp_pass.cost.step_summary import StepSummary
from fsdp_pass.search.last_unit import zero3_reshards
from fsdp_pass.search.unit_search import NO_MOVE, Priced, block_starts, fits, greedy_units
from fsdp_pass.text import human_bytes


def units_for(decisions: PerUnitDecisions, prefetch: int, offload: bool) -> tuple[Priced, list[str]]:
    """The units of the greedy search (item 2) at one prefetch depth and offload, with a reason per move."""
    search = greedy_units(decisions.summary, lambda starts: decisions.tried(starts, prefetch, offload),
                          decisions.budget)
    if search.within_error:
        return search.blocks, [f"units: one per block; {search.within_error_text()}, not worth the change"]
    return search.found, [move_reason(decisions.summary, decisions.cost, decisions.budget, t) for t in search.taken]


def smallest_peak(summary: StepSummary, cost: CostInputs, offload: bool = True, checkpoint: bool = True) -> Prediction:
    """The lowest peak any plan reaches: every piece its own unit, all resharded, no prefetch (with ``checkpoint``,
    every unit checkpointed: the lowest of full and selective for each, which is full unless it keeps more)."""
    n = len(summary.pieces)
    finest = Candidate(tuple(range(n)), (True,) * (n - 1) + (False,), 0, offload)
    if checkpoint:
        finest = with_moves(finest, moves(summary, finest, cost))
    return predict(summary, finest, cost)


def _first_stage_that_fits(summary: StepSummary, cost: CostInputs, budget, offload, checkpointing: bool,
                           prefetch_depths, reasons: list[str]):
    """Plans without checkpointing or offload, then with checkpointing, then with offload (checkpointing before
    offload: offload needs the user's offload_to), until a prefetch depth's plan fits; appends to ``reasons`` why
    each stage was passed. Returns the last stage's planner, its plans by depth and those that fit (none: nothing)."""
    choices = (False, True) if offload is None else (offload,)
    stages = [(off, ckpt) for off in choices for ckpt in ((False, True) if checkpointing else (False,))]
    fitting: dict = {}
    for off, ckpt in stages:
        planner = PerUnitDecisions(summary, cost, budget, ckpt)
        tried = {d: units_for(planner, d, off) for d in prefetch_depths}
        fitting = {d: t for d, t in tried.items() if fits(t[0].prediction, budget)}
        if fitting:
            break
        least = min(t[0].prediction.peak_bytes for t in tried.values())
        if not ckpt and checkpointing:
            reasons.append(f"checkpointing considered: without it no plan fits (a peak of {human_bytes(least)} at "
                           f"best{', offload on' if off else ''})")
        elif not off and offload is None:
            reasons.append(f"offload on: without it no plan fits (a peak of {human_bytes(least)} at best, "
                           "checkpointing included), so the shards, their gradients and the optimizer state live on "
                           "the host between uses")
    return planner, tried, fitting


def plan_step(
    summary: StepSummary,
    cost: CostInputs,
    budget: int | None = None,
    *,
    offload: bool | None = None,
    prefetch_depths=PREFETCH_DEPTHS,
    checkpointing: bool = True,
) -> AutoPlan:
    """The fastest predicted plan whose predicted peak is within ``budget`` bytes (module docstring).
    ``offload``: None lets the planner turn it on when nothing fits without; True or False decides it.
    ``checkpointing``: whether units may checkpoint their activations when nothing fits without.
    The hand-written ZeRO-3 plan it is compared with keeps its last unit as ``plan_units`` would
    (:func:`~fsdp_pass.search.last_unit.zero3_reshards`)."""
    check(len(summary.pieces) > 0, "The step reads no parameters: there is nothing to plan.",
          "Plan a model whose forward reads its parameters.")
    check(budget is None or budget > 0, f"memory_budget={budget!r} is not a positive number of bytes.",
          "Pass e.g. memory_budget='20GiB'.")
    reasons: list[str] = []
    choices = (False, True) if offload is None else (offload,)
    planner, tried, fitting = _first_stage_that_fits(summary, cost, budget, offload, checkpointing, prefetch_depths,
                                                     reasons)
    if not fitting:
        _no_planfits(summary, cost, budget, choices[-1], checkpointing)
    if any(d > 0 for d in fitting):  # prefetch 0 is a memory measure only (module docstring)
        fitting = {d: t for d, t in fitting.items() if d > 0}
    depth = min(fitting, key=lambda d: (fitting[d][0].prediction.step_s, abs(d - 1)))  # ties: the default, 1
    best, move_reasons = fitting[depth]
    best = planner.fewest_checkpointed(best)
    best = planner.fewest_resharded(best)
    best, depth_reasons = planner.per_unit_depths(best)
    if offload is not None:
        reasons.append(f"offload {'on' if offload else 'off'}: as asked")
    elif not reasons:
        reasons.append("offload off: the plan fits on the device" if budget is not None else "offload off: no budget")
    reasons.append(
        f"prefetch {depth}: predicted step "
        + ", ".join(f"{ms(t[0].prediction.step_s)} with prefetch {d}"
                    + depth_note(d, t[0].prediction, fitting, budget) for d, t in tried.items())
    )
    reasons.extend(move_reasons or [f"units: one per block; {NO_MOVE}"])
    reasons.extend(depth_reasons)
    reasons.extend(reshard_reasons(summary, best, budget, cost))
    if best.candidate.checkpoint:
        without = predict(summary, replace(best.candidate, checkpoint=()), cost, list(best.names)).peak_bytes
        reasons.extend(checkpoint_reasons(summary, best.candidate, cost, best.names, without, budget))
    elif checkpointing and budget is not None:
        reasons.append("no unit checkpoints its activations: the plan fits without")
    return AutoPlan(summary, best.candidate, best.names, best.prediction, budget, cost, tuple(reasons),
                    _compared(summary, cost, best.candidate.offload))


def _no_planfits(summary: StepSummary, cost: CostInputs, budget: int, offload: bool, checkpointing: bool):
    low = smallest_peak(summary, cost, offload, checkpointing)
    how = ", every unit checkpointed" if checkpointing else ""
    fail(
        f"No plan fits memory_budget={human_bytes(budget)}: the smallest predicted peak is "
        f"{human_bytes(low.peak_bytes)} (every piece its own unit, all resharded after forward, no prefetch"
        f"{', offload on' if offload else ''}{how}); without checkpointing "
        f"{human_bytes(summary.activation_bytes)} are activations.",
        f"Pass memory_budget >= {human_bytes(low.peak_bytes)} (or {low.peak_bytes} bytes), or use more ranks.",
    )


def _compared(summary: StepSummary, cost: CostInputs, offload: bool) -> tuple[tuple[str, Prediction], ...]:
    starts = block_starts(summary)
    zero2 = Candidate(starts, (False,) * len(starts), 1, offload)
    zero3 = replace(zero2, reshard=zero3_reshards(summary, zero2))
    return (("blocks, ZeRO-3, prefetch 1", predict(summary, zero3, cost)),
            ("blocks, ZeRO-2, prefetch 1", predict(summary, zero2, cost)))

