"""The auto planner's decisions per unit (:mod:`fsdp_pass.search.auto_plan`, items 3-5), for one set of units:
which reshard after forward (as few as bring the peak within the budget), which prefetch at a depth of their
own, and which checkpoint their activations (:mod:`fsdp_pass.search.auto_checkpoint`). :meth:`PerUnitDecisions.tried`
prices a set of units with the first two decisions made fast, for the search over units
(:mod:`fsdp_pass.search.unit_search`); the others refine the plan chosen.
"""

from __future__ import annotations

from dataclasses import replace

from fsdp_pass.search.auto_checkpoint import checkpointed_for_budget, fewest_checkpointed
from fsdp_pass.search.auto_plan_text import depth_reason
from fsdp_pass.cost.candidate_costs import Candidate, unit_costs
from fsdp_pass.cost.cost_model import CostInputs
from fsdp_pass.cost.step_model import peak_of, persistent_bytes, predict
from fsdp_pass.cost.step_summary import StepSummary
from fsdp_pass.search.unit_search import Priced, better, fits, unit_names

PREFETCH_DEPTHS = (0, 1, 2)


class PerUnitDecisions:
    """The per-unit decisions for one step summary, cost inputs and budget; ``checkpointing``: whether units may
    checkpoint their activations where resharding them all is not enough."""

    def __init__(self, summary: StepSummary, cost: CostInputs, budget: int | None, checkpointing: bool = False):
        self.summary, self.cost, self.budget = summary, cost, budget
        self.checkpointing = checkpointing  # units may checkpoint activations where resharding all is not enough

    def reshard_for_budget(self, starts, prefetch: int, offload: bool) -> Candidate:
        """Keep every unit gathered, or reshard the largest first, as few as bring the peak within budget (fast:
        what the search over units compares; :meth:`fewest_resharded` refines the chosen plan's)."""
        keep_all = Candidate(starts, (False,) * len(starts), prefetch, offload)
        if self.budget is None:
            return keep_all
        units = unit_costs(self.summary, keep_all, self.cost)
        names = [""] * len(units)
        persistent = persistent_bytes(self.summary, offload)
        by_size = sorted(range(len(units) - 1), key=lambda i: (-units[i].gathered, i))

        def flipped(m: int) -> Candidate:
            chosen = set(by_size[:m])
            return replace(keep_all, reshard=tuple(i in chosen for i in range(len(units))))

        def within(m: int) -> bool:
            return peak_of(units, flipped(m), names, persistent, self.summary.output_bytes,
                           self.summary.loss_bytes)[0] <= self.budget

        lo, hi = 0, len(by_size)
        if not within(hi):
            return flipped(hi)
        while lo < hi:  # the peak falls as more units reshard: the fewest that fit
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if within(mid) else (mid + 1, hi)
        return flipped(lo)

    def fewest_resharded(self, t: Priced) -> Priced:
        """Reshard again from none, each time the unit that lowers the peak most, until it fits; then keep
        gathered each one that can be without the peak leaving the budget. Keeps ``t`` when it needs fewer."""
        if self.budget is None or not any(t.candidate.reshard):
            return t
        c = replace(t.candidate, reshard=(False,) * len(t.candidate.reshard))
        units = unit_costs(self.summary, c, self.cost)
        persistent = persistent_bytes(self.summary, c.offload)

        def peak(flags) -> int:
            candidate = replace(c, reshard=tuple(flags))
            return peak_of(units, candidate, list(t.names), persistent, self.summary.output_bytes,
                           self.summary.loss_bytes)[0]

        flags = [False] * len(units)
        while peak(flags) > self.budget:
            options = [i for i in range(len(units) - 1) if not flags[i]]
            if not options:
                return t
            best = min(options, key=lambda i: (peak(flags[:i] + [True] + flags[i + 1 :]), -units[i].gathered))
            flags[best] = True
        for i in sorted((i for i in range(len(flags)) if flags[i]), key=lambda i: units[i].gathered):
            if peak(flags[:i] + [False] + flags[i + 1 :]) <= self.budget:
                flags[i] = False
        if sum(flags) >= sum(t.candidate.reshard):
            return t
        refined = replace(c, reshard=tuple(flags))
        return Priced(refined, predict(self.summary, refined, self.cost, list(t.names)), t.names)

    def kept_where_it_fits(self, c: Candidate, names: tuple[str, ...]) -> Priced | None:
        """``c`` with each resharded unit kept gathered instead (the smallest first) that the budget allows;
        None when ``c`` itself is over the budget."""
        units = unit_costs(self.summary, c, self.cost)
        persistent = persistent_bytes(self.summary, c.offload)

        def within(flags) -> bool:
            candidate = replace(c, reshard=tuple(flags))
            return self.budget is None or peak_of(units, candidate, list(names), persistent,
                                                  self.summary.output_bytes, self.summary.loss_bytes)[0] <= self.budget

        flags = list(c.reshard)
        if not within(flags):
            return None
        for i in sorted((i for i in range(len(flags)) if flags[i]), key=lambda i: units[i].gathered):
            if within(flags[:i] + [False] + flags[i + 1 :]):
                flags[i] = False
        c = replace(c, reshard=tuple(flags))
        return Priced(c, predict(self.summary, c, self.cost, list(names)), names)

    def per_unit_depths(self, t: Priced) -> tuple[Priced, list[str]]:
        """Give units a prefetch depth of their own, one unit and one depth at a time, where that shortens the
        predicted step within the budget (a unit gathered later may let others stay gathered)."""
        now, reasons = t, []
        k = len(t.candidate.starts)
        for _ in range(2):
            moved = False
            for i in range(k):
                for d in PREFETCH_DEPTHS:
                    depths = list(now.candidate.depths or (now.candidate.prefetch,) * k)
                    if depths[i] == d or (d == 0 and now.candidate.prefetch > 0):
                        continue
                    depths[i] = d
                    trial = self.kept_where_it_fits(replace(now.candidate, depths=tuple(depths)), now.names)
                    if (trial is not None and fits(trial.prediction, self.budget)
                            and better(trial.prediction, now.prediction, self.budget)):
                        reasons.append(depth_reason(i, d, now, trial))
                        now, moved = trial, True
            if not moved:
                break
        c = now.candidate
        if c.depths and all(d == c.prefetch for d in c.depths):
            now = replace(now, candidate=replace(c, depths=()))
        return now, reasons

    def tried(self, starts, prefetch: int, offload: bool) -> Priced:
        """The units ``starts`` priced as the search over units compares them: resharded for the budget
        (:meth:`reshard_for_budget`), and checkpointed for it when that is not enough and allowed."""
        candidate = self.reshard_for_budget(tuple(starts), prefetch, offload)
        names = unit_names(self.summary, candidate.starts)
        prediction = predict(self.summary, candidate, self.cost, names)
        if self.checkpointing and not fits(prediction, self.budget):
            candidate = checkpointed_for_budget(self.summary, candidate, self.cost, self.budget, names)
            prediction = predict(self.summary, candidate, self.cost, names)
        return Priced(candidate, prediction, tuple(names))

    def fewest_checkpointed(self, t: Priced) -> Priced:
        """``t`` with each unit's checkpointing stepped down where the budget allows (auto_checkpoint item 3)."""
        c = fewest_checkpointed(self.summary, t.candidate, self.cost, self.budget, t.names)
        return t if c == t.candidate else Priced(c, predict(self.summary, c, self.cost, list(t.names)), t.names)
