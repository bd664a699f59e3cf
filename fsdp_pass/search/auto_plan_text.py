"""The auto plan as it prints: :class:`AutoPlan` (the planner's choice, its table of units and its reasons) and
the sentences that give each decision's reason (:mod:`fsdp_pass.search.auto_plan` decides, this words it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fsdp_pass.cost.candidate_costs import OPS_PER_COLLECTIVE, Candidate, unit_costs
from fsdp_pass.plan.checkpointing import NONE
from fsdp_pass.cost.cost_model import CostInputs
from fsdp_pass.cost.step_model import Prediction, ms, predict
from fsdp_pass.cost.step_summary import StepSummary
from fsdp_pass.search.unit_search import Priced, Taken, fits
from fsdp_pass.text import format_table, human_bytes


@dataclass(frozen=True)
class AutoPlan:
    """The planner's choice for one step, with its prediction and its reasons."""

    summary: StepSummary
    candidate: Candidate
    names: tuple[str, ...]
    prediction: Prediction
    budget: int | None
    cost: CostInputs
    reasons: tuple[str, ...]
    compared: tuple[tuple[str, Prediction], ...] = ()  # hand-written plans, predicted by the same model

    @property
    def groups(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """(unit name, parameter names) per unit, in forward order: what a unit policy returns."""
        spans = self.candidate.spans(len(self.summary.pieces))
        return tuple((n, tuple(p for i in s for p in self.summary.pieces[i].params)) for n, s in zip(self.names, spans))

    @property
    def resharded(self) -> frozenset[str]:
        return frozenset(n for n, r in zip(self.names, self.candidate.reshard) if r)

    @property
    def checkpoint_by_unit(self) -> dict[str, str]:
        """The units whose activations are checkpointed, and at which level (plan.checkpointing)."""
        c = self.candidate
        return {n: c.level_of(i) for i, n in enumerate(self.names) if c.level_of(i) != NONE}

    @property
    def prefetch_by_unit(self) -> dict[str, int]:
        """The units whose prefetch depth is their own (``Schedule.prefetch_by_unit``)."""
        c = self.candidate
        return {n: c.depth_of(i) for i, n in enumerate(self.names) if c.depth_of(i) != c.prefetch}

    def __str__(self) -> str:
        p, c = self.prediction, self.candidate
        costs = unit_costs(self.summary, c, self.cost)
        rows = [
            (name, len(span), human_bytes(u.gathered), "yes" if r else "no", c.depth_of(i), c.level_of(i),
             human_bytes(u.activations), ms(u.forward_total_s() + u.backward_total_s(r)), ms(u.gather_s),
             ms(u.reduce_s))
            for i, (name, span, u, r) in enumerate(zip(self.names, c.spans(len(self.summary.pieces)), costs, c.reshard))
        ]
        budget = "no budget" if self.budget is None else f"budget {human_bytes(self.budget)}"
        own = f" ({len(self.prefetch_by_unit)} unit(s) their own)" if self.prefetch_by_unit else ""
        replicas = self.summary.replicas
        hsdp = f" per shard group x {replicas} replicas (HSDP)" if replicas > 1 else ""
        reduce = "reduce-scatter + all-reduce" if replicas > 1 else "reduce-scatter"
        lines = [
            f"Auto plan over {self.summary.ranks} ranks{hsdp}: {len(self.names)} units, prefetch {c.prefetch}{own}, "
            f"offload {'on' if c.offload else 'off'}; {budget}",
            f"cost inputs: {self.cost}",
            *format_table(("unit", "pieces", "gathered", "reshard", "prefetch", "checkpoint", "kept", "compute",
                           "gather", reduce), rows),
            *p.lines(self.budget),
        ]
        for name, other in self.compared:
            over = "" if fits(other, self.budget) else ", over the budget"
            lines.append(f"  vs {name}: step {ms(other.step_s)}, peak {human_bytes(other.peak_bytes)}{over}")
        lines.append("why:")
        lines.extend(f"  {r}" for r in self.reasons)
        return "\n".join(lines)


def move_reason(summary: StepSummary, cost: CostInputs, budget: int | None, taken: Taken) -> str:
    """Why the search merged or split: what the merge saves (or the split overlaps), and the predicted step (or,
    while nothing fits, the peak) before and after."""
    move, old = taken.move, taken.before
    a, b = move.unit, move.other
    before, after = old.prediction, taken.after.prediction
    sizes = dict(zip(old.names, unit_costs(summary, old.candidate, cost)))
    if move.kind == "merge":
        ga, gb = sizes[a].gathered, sizes[b].gathered
        alpha = f"alpha {cost.link.alpha_s * 1e6:.3g} us each"
        if cost.op_s:
            alpha += f", and {OPS_PER_COLLECTIVE} ops of {cost.op_s * 1e6:.3g} us on the host"
        if summary.replicas > 1:
            across = cost.across_replicas.alpha_s * 1e6
            alpha += f"; an all-reduce fewer across replicas, alpha {across:.3g} us"
        head = (f"{a} and {b} merged: one {human_bytes(ga + gb)} gather instead of {human_bytes(ga)} + "
                f"{human_bytes(gb)}, a collective fewer each time ({alpha})")
    else:
        head = f"{a} split before {b}: two smaller gathers, the second can overlap the first part's compute"
    if fits(after, budget) and fits(before, budget):
        return f"{head}: predicted step {ms(before.step_s)} -> {ms(after.step_s)}"
    if move.kind == "split":
        head = f"{a} split before {b}: smaller units, less gathered at once"
    within = " (within the budget now)" if fits(after, budget) else ""
    return f"{head}: predicted peak {human_bytes(before.peak_bytes)} -> {human_bytes(after.peak_bytes)}{within}"


def depth_reason(i: int, d: int, old: Priced, new: Priced) -> str:
    """Why unit ``i`` prefetches at depth ``d`` of its own."""
    was = old.candidate.depth_of(i)
    how = ("issued later: its gathered bytes are held for less time" if d < was
           else "issued earlier: more of it hides behind compute")
    fewer = sum(old.candidate.reshard) - sum(new.candidate.reshard)
    kept = f"; {fewer} unit(s) fewer reshard within the budget" if fewer > 0 else ""
    before, after = old.prediction, new.prediction
    return (f"{old.names[i]} prefetch {d} (was {was}): its gather {how}{kept}: predicted step "
            f"{ms(before.step_s)} -> {ms(after.step_s)}, peak {human_bytes(before.peak_bytes)} -> "
            f"{human_bytes(after.peak_bytes)}")


def depth_note(d: int, pred: Prediction, fitting: dict, budget: int | None) -> str:
    """Why prefetch depth ``d`` lost, when it did not fit or is 0 beside a deeper one that fits."""
    if d in fitting:
        return ""
    if fits(pred, budget):
        return " (prefetch 0 only when nothing deeper fits)"
    return " (over budget)"


def reshard_reasons(summary: StepSummary, t: Priced, budget: int | None, cost: CostInputs) -> list[str]:
    """Why every unit stays gathered, or which units reshard after forward and what each frees."""
    c = t.candidate
    if not any(c.reshard):
        why = "no budget" if budget is None else f"the peak {human_bytes(t.prediction.peak_bytes)} fits"
        return [f"every unit stays gathered from its forward to its backward (ZeRO-2, no second gather): {why}"]
    kept = replace(c, reshard=(False,) * len(c.reshard))
    peak_kept = predict(summary, kept, cost, list(t.names)).peak_bytes
    units = unit_costs(summary, c, cost)
    out = [f"keeping every unit gathered peaks at {human_bytes(peak_kept)} > budget {human_bytes(budget)}: "
           f"{sum(c.reshard)} unit(s) reshard after forward (ZeRO-3), each the one that lowered the peak most"]
    for name, u, r in zip(t.names, units, c.reshard):
        if r:
            out.append(f"{name} reshards after forward: frees {human_bytes(u.gathered)} until its backward "
                       f"gathers it again ({ms(u.gather_s)})")
    return out
