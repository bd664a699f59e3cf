"""The auto planner's activation checkpointing: which units recompute what in the backward, only where the budget
needs it, the cheapest first. Pure functions of a step summary, a candidate plan, cost inputs and a budget.

1. :func:`moves`: per unit, two moves, each with the bytes it frees and the recompute time it costs
   (:func:`~fsdp_pass.cost.candidate_costs.kept_and_recompute`): to ``selective`` (keep its matmuls' and attentions'
   results, recompute the cheap ops between them), then from there to ``full`` (keep only what leaves the unit,
   recompute all of it). Every selective move comes before every full one; within each kind, the units whose
   move frees most bytes per recompute second first.
2. :func:`checkpointed_for_budget`: the shortest prefix of those moves that brings the candidate's peak within
   the budget (the peak falls as moves are added: a binary search), or all of them when none does.
3. :func:`fewest_checkpointed`: then each move taken, the costliest first, is undone where the peak stays within
   the budget without it (the peak is not where the moves were ordered for, e.g. a unit's own recompute at the
   start of its backward).
4. :func:`checkpoint_reasons`: one line per checkpointed unit: its level, what it keeps instead of what, what it
   recomputes and for how long.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fsdp_pass.cost.candidate_costs import Candidate, kept_and_recompute, unit_costs
from fsdp_pass.plan.checkpointing import FULL, NONE, SELECTIVE
from fsdp_pass.cost.cost_model import CostInputs
from fsdp_pass.cost.step_model import ms, peak_of, persistent_bytes
from fsdp_pass.cost.step_summary import StepSummary
from fsdp_pass.text import human_bytes


@dataclass(frozen=True)
class Move:
    unit: int
    level: str  # what the unit goes to
    frees: int  # bytes it keeps no longer
    costs_s: float  # recompute seconds it adds to the backward


def _levels(summary: StepSummary, c: Candidate, cost: CostInputs, unit: int) -> dict[str, tuple[int, float]]:
    span = c.spans(len(summary.pieces))[unit]
    return {level: kept_and_recompute(summary, span, level, cost) for level in (NONE, SELECTIVE, FULL)}


def moves(summary: StepSummary, c: Candidate, cost: CostInputs) -> list[Move]:
    """Every unit's move to selective, then every unit's move from selective to full, each kind by bytes freed per
    recompute second, most first (moves that free nothing left out)."""
    by_kind: dict[str, list[Move]] = {SELECTIVE: [], FULL: []}
    for u in range(len(c.starts)):
        levels = _levels(summary, c, cost, u)
        for was, to in ((NONE, SELECTIVE), (SELECTIVE, FULL)):
            frees = levels[was][0] - levels[to][0]
            if frees > 0:
                by_kind[to].append(Move(u, to, frees, levels[to][1] - levels[was][1]))
    for kind in by_kind.values():
        kind.sort(key=lambda m: (-m.frees / max(m.costs_s, 1e-12), m.unit))
    return by_kind[SELECTIVE] + by_kind[FULL]


def with_moves(c: Candidate, taken) -> Candidate:
    """``c`` with the units' levels the ``taken`` moves give (a later move of a unit overrides an earlier)."""
    levels = list(c.checkpoint or (NONE,) * len(c.starts))
    for m in taken:
        levels[m.unit] = m.level
    return replace(c, checkpoint=tuple(levels) if any(lv != NONE for lv in levels) else ())


def _peak(summary: StepSummary, c: Candidate, cost: CostInputs, names) -> int:
    units = unit_costs(summary, c, cost)
    return peak_of(units, c, list(names), persistent_bytes(summary, c.offload), summary.output_bytes,
                   summary.loss_bytes)[0]


def checkpointed_for_budget(summary: StepSummary, c: Candidate, cost: CostInputs, budget: int, names) -> Candidate:
    """``c`` (no unit checkpointed) with the shortest prefix of :func:`moves` that fits ``budget`` (all of them when
    none does)."""
    todo = moves(summary, c, cost)
    lo, hi = 0, len(todo)
    if _peak(summary, with_moves(c, todo), cost, names) > budget:
        return with_moves(c, todo)
    while lo < hi:
        mid = (lo + hi) // 2
        if _peak(summary, with_moves(c, todo[:mid]), cost, names) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return with_moves(c, todo[:lo])


def fewest_checkpointed(summary: StepSummary, c: Candidate, cost: CostInputs, budget: int | None, names) -> Candidate:
    """``c`` with each unit's checkpointing stepped down (full to selective to none), the costliest recompute
    first, wherever its peak stays within ``budget``."""
    if budget is None or not c.checkpoint:
        return c
    down = {FULL: SELECTIVE, SELECTIVE: NONE}
    while True:
        options = []
        for u, level in enumerate(c.checkpoint or ()):
            if level != NONE:
                levels = _levels(summary, c, cost, u)
                options.append((levels[level][1] - levels[down[level]][1], u, down[level]))
        for _, u, lower in sorted(options, reverse=True):
            trial = with_moves(c, [Move(u, lower, 0, 0.0)])
            if _peak(summary, trial, cost, names) <= budget:
                c = trial
                break
        else:
            return c


def checkpoint_reasons(summary: StepSummary, c: Candidate, cost: CostInputs, names, without_peak: int,
                       budget: int | None) -> list[str]:
    """Why the plan checkpoints: the peak it would have without, and per checkpointed unit what it keeps and
    recomputes."""
    if not c.checkpoint:
        return []
    count = sum(lv != NONE for lv in c.checkpoint)
    out = [f"activation checkpointing in {count} unit(s): without it the plan peaks at {human_bytes(without_peak)} > "
           f"budget {human_bytes(budget)}; selective before full, the units that free most bytes per recompute "
           "second first, as few as fit"]
    for u, level in enumerate(c.checkpoint):
        if level == NONE:
            continue
        levels = _levels(summary, c, cost, u)
        every, kept, seconds = levels[NONE][0], levels[level][0], levels[level][1]
        what = ("keeps its matmuls' and attentions' results, recomputes the ops between them" if level == SELECTIVE
                else "keeps only what leaves it, recomputes its whole forward")
        out.append(f"{names[u]} checkpointed ({level}): {what}: keeps {human_bytes(kept)} instead of "
                   f"{human_bytes(every)} ({human_bytes((every - kept) / max(seconds, 1e-12))} per recompute "
                   f"second), its backward {ms(seconds)} longer")
    return out
