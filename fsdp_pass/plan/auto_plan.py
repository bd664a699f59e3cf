"""The auto planner: units, reshard-after-forward per unit, prefetch depth and offload, chosen to make the
predicted step fastest within a memory budget, each decision with its reason.

``plan_step(summary, cost, budget) -> AutoPlan`` is a pure function of a
:class:`~fsdp_pass.plan.step_summary.StepSummary`, :class:`~fsdp_pass.plan.cost_model.CostInputs` and a budget
in bytes (None: no bound). Predictions come from :func:`~fsdp_pass.plan.step_model.predict`.

1. Offload stays off if any plan fits without it; prefetch depths 0, 1 and 2 are each planned, and the
   fastest plan that fits wins.
2. For one prefetch depth, start from one unit per block (the ``Blocks`` policy's units) and move greedily:
   at each step try merging every two neighbouring units and splitting every unit at each of its pieces, and
   take the move that shortens the predicted step most; stop when none does. A move that needs more memory
   than the budget gives is taken only with the resharding below.
3. For one set of units, keep every unit gathered from its forward to its backward (ZeRO-2, no second
   gather) unless the peak exceeds the budget; then reshard units (ZeRO-3 for them), as few as bring the
   peak within the budget: while searching, the largest first; for the plan chosen, each time the one that
   lowers the peak most, then back to kept each that the budget allows. The last unit the forward gathers
   is never resharded: the backward starts with it, so freeing it would only mean gathering it again.
4. No plan fits: an FSDPError naming the smallest budget one does (every piece its own unit, all resharded,
   no prefetch, offload on when allowed).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fsdp_pass.errors import check, fail
from fsdp_pass.plan.cost_model import CostInputs
from fsdp_pass.plan.step_model import Candidate, Prediction, peak_of, persistent_bytes, predict, unit_costs
from fsdp_pass.plan.step_summary import StepSummary
from fsdp_pass.text import format_table, human_bytes

PREFETCH_DEPTHS = (0, 1, 2)
_BETTER = 1e-3  # a move must shorten the predicted step by this fraction to be taken


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _fits(pred: Prediction, budget: int | None) -> bool:
    return budget is None or pred.peak_bytes <= budget


def _rank(pred: Prediction, budget: int | None) -> tuple:
    """Smaller is better: plans that fit first, by step time; the others by peak."""
    return (0, pred.step_s) if _fits(pred, budget) else (1, pred.peak_bytes)


def unit_names(summary: StepSummary, starts: tuple[int, ...]) -> list[str]:
    """A name per unit: its block when it is exactly one block, else its first and last piece (or block)."""
    pieces, n = summary.pieces, len(summary.pieces)
    pieces_of_block: dict[str, list[int]] = {}
    for i, p in enumerate(pieces):
        pieces_of_block.setdefault(p.block, []).append(i)
    names, seen = [], {}
    for a, b in zip(starts, (*starts[1:], n)):
        blocks = list(dict.fromkeys(pieces[i].block for i in range(a, b)))
        whole = all(pieces_of_block[blk] == [i for i in range(a, b) if pieces[i].block == blk] for blk in blocks)
        if whole:
            name = blocks[0] if len(blocks) == 1 else f"{blocks[0]}..{blocks[-1]}"
        else:
            name = pieces[a].name if b - a == 1 else f"{pieces[a].name}..{pieces[b - 1].name}"
        seen[name] = seen.get(name, 0) + 1
        names.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return names


def _block_starts(summary: StepSummary) -> tuple[int, ...]:
    return tuple(i for i, p in enumerate(summary.pieces) if i == 0 or p.block != summary.pieces[i - 1].block)


@dataclass(frozen=True)
class _Tried:
    candidate: Candidate
    prediction: Prediction
    names: tuple[str, ...]


class _Planner:
    def __init__(self, summary: StepSummary, cost: CostInputs, budget: int | None):
        self.summary, self.cost, self.budget = summary, cost, budget

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

        def fits(m: int) -> bool:
            return peak_of(units, flipped(m), names, persistent)[0] <= self.budget

        lo, hi = 0, len(by_size)
        if not fits(hi):
            return flipped(hi)
        while lo < hi:  # the peak falls as more units reshard: the fewest that fit
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
        return flipped(lo)

    def fewest_resharded(self, t: _Tried) -> _Tried:
        """Reshard again from none, each time the unit that lowers the peak most, until it fits; then keep
        gathered each one that can be without the peak leaving the budget. Keeps ``t`` when it needs fewer."""
        if self.budget is None or not any(t.candidate.reshard):
            return t
        c = replace(t.candidate, reshard=(False,) * len(t.candidate.reshard))
        units = unit_costs(self.summary, c, self.cost)
        persistent = persistent_bytes(self.summary, c.offload)

        def peak(flags) -> int:
            return peak_of(units, replace(c, reshard=tuple(flags)), list(t.names), persistent)[0]

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
        return _Tried(refined, predict(self.summary, refined, self.cost, list(t.names)), t.names)

    def tried(self, starts, prefetch: int, offload: bool) -> _Tried:
        candidate = self.reshard_for_budget(tuple(starts), prefetch, offload)
        names = unit_names(self.summary, candidate.starts)
        return _Tried(candidate, predict(self.summary, candidate, self.cost, names), tuple(names))

    def moves(self, starts: tuple[int, ...]):
        """(description, new starts) of every merge of two neighbours and every split of a unit."""
        n = len(self.summary.pieces)
        names = unit_names(self.summary, starts)
        for u in range(1, len(starts)):
            yield ("merge", names[u - 1], names[u]), starts[:u] + starts[u + 1 :]
        ends = (*starts[1:], n)
        for u, (a, b) in enumerate(zip(starts, ends)):
            for cut in range(a + 1, b):
                yield ("split", names[u], self.summary.pieces[cut].name), tuple(sorted((*starts, cut)))

    def units_for(self, prefetch: int, offload: bool) -> tuple[_Tried, list[str]]:
        """Greedy moves from one unit per block, as long as one shortens the predicted step (or, while
        nothing fits, lowers the peak)."""
        now = self.tried(_block_starts(self.summary), prefetch, offload)
        reasons: list[str] = []
        for _ in range(4 * len(self.summary.pieces)):
            best = None
            for what, starts in self.moves(now.candidate.starts):
                t = self.tried(starts, prefetch, offload)
                if best is None or _rank(t.prediction, self.budget) < _rank(best[1].prediction, self.budget):
                    best = (what, t)
            if best is None or not self._better(best[1].prediction, now.prediction):
                break
            reasons.append(self._move_reason(best[0], now, best[1]))
            now = best[1]
        return now, reasons

    def _better(self, new: Prediction, old: Prediction) -> bool:
        if _fits(new, self.budget) != _fits(old, self.budget):
            return _fits(new, self.budget)
        if not _fits(new, self.budget):
            return new.peak_bytes < old.peak_bytes
        return new.step_s < old.step_s * (1 - _BETTER)

    def _move_reason(self, what, old: _Tried, new: _Tried) -> str:
        kind, a, b = what
        before, after = old.prediction, new.prediction
        sizes = dict(zip(old.names, unit_costs(self.summary, old.candidate, self.cost)))
        if kind == "merge":
            ga, gb = sizes[a].gathered, sizes[b].gathered
            alpha = f"alpha {self.cost.link.alpha_s * 1e6:.3g} us each"
            head = (f"{a} and {b} merged: one {human_bytes(ga + gb)} gather instead of {human_bytes(ga)} + "
                    f"{human_bytes(gb)}, a collective fewer each time ({alpha})")
        else:
            head = f"{a} split before {b}: two smaller gathers, the second can overlap the first part's compute"
        if _fits(after, self.budget) and _fits(before, self.budget):
            return f"{head}: predicted step {_ms(before.step_s)} -> {_ms(after.step_s)}"
        if kind == "split":
            head = f"{a} split before {b}: smaller units, less gathered at once"
        fits = " (within the budget now)" if _fits(after, self.budget) else ""
        return f"{head}: predicted peak {human_bytes(before.peak_bytes)} -> {human_bytes(after.peak_bytes)}{fits}"


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

    def __str__(self) -> str:
        p, c = self.prediction, self.candidate
        costs = unit_costs(self.summary, c, self.cost)
        rows = [
            (name, len(span), human_bytes(u.gathered), "yes" if r else "no", _ms(3 * u.forward_s),
             _ms(u.gather_s), _ms(u.reduce_s))
            for name, span, u, r in zip(self.names, c.spans(len(self.summary.pieces)), costs, c.reshard)
        ]
        budget = "no budget" if self.budget is None else f"budget {human_bytes(self.budget)}"
        lines = [
            f"Auto plan over {self.summary.ranks} ranks: {len(self.names)} units, prefetch {c.prefetch}, "
            f"offload {'on' if c.offload else 'off'}; {budget}",
            f"cost inputs: {self.cost}",
            *format_table(("unit", "pieces", "gathered", "reshard", "compute", "gather", "reduce-scatter"), rows),
            f"predicted step {_ms(p.step_s)} = compute {_ms(p.compute_s)} + exposed communication {_ms(p.exposed_s)}",
            f"predicted peak {human_bytes(p.peak_bytes)} ({p.peak_at}; {human_bytes(p.persistent_bytes)} of it "
            f"between steps)" + ("" if self.budget is None else f" of the {human_bytes(self.budget)} budget"),
        ]
        for name, other in self.compared:
            fits = "" if _fits(other, self.budget) else ", over the budget"
            lines.append(f"  vs {name}: step {_ms(other.step_s)}, peak {human_bytes(other.peak_bytes)}{fits}")
        lines.append("why:")
        lines.extend(f"  {r}" for r in self.reasons)
        return "\n".join(lines)


def _reshard_reasons(summary: StepSummary, t: _Tried, budget: int | None, cost: CostInputs) -> list[str]:
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
                       f"gathers it again ({_ms(u.gather_s)})")
    return out


def smallest_peak(summary: StepSummary, cost: CostInputs, offload: bool = True) -> Prediction:
    """The lowest peak any plan reaches: every piece its own unit, all resharded, no prefetch."""
    n = len(summary.pieces)
    finest = Candidate(tuple(range(n)), (True,) * (n - 1) + (False,), 0, offload)
    return predict(summary, finest, cost)


def plan_step(
    summary: StepSummary,
    cost: CostInputs,
    budget: int | None = None,
    *,
    offload: bool | None = None,
    prefetch_depths=PREFETCH_DEPTHS,
) -> AutoPlan:
    """The fastest predicted plan whose predicted peak is within ``budget`` bytes (module docstring).
    ``offload``: None lets the planner turn it on when nothing fits without; True or False decides it."""
    check(len(summary.pieces) > 0, "The step reads no parameters: there is nothing to plan.",
          "Plan a model whose forward reads its parameters.")
    check(budget is None or budget > 0, f"memory_budget={budget!r} is not a positive number of bytes.",
          "Pass e.g. memory_budget='20GiB'.")
    planner = _Planner(summary, cost, budget)
    reasons: list[str] = []
    choices = (False, True) if offload is None else (offload,)
    fitting: dict = {}
    for off in choices:
        tried = {d: planner.units_for(d, off) for d in prefetch_depths}
        fitting = {d: t for d, t in tried.items() if _fits(t[0].prediction, budget)}
        if fitting:
            break
        if not off and offload is None:
            least = min(t[0].prediction.peak_bytes for t in tried.values())
            reasons.append(f"offload on: without it no plan fits (a peak of {human_bytes(least)} at best), so the "
                           "shards, their gradients and the optimizer state live on the host between uses")
    if not fitting:
        low = smallest_peak(summary, cost, choices[-1])
        fail(
            f"No plan fits memory_budget={human_bytes(budget)}: the smallest predicted peak is "
            f"{human_bytes(low.peak_bytes)} (every piece its own unit, all resharded after forward, no prefetch"
            f"{', offload on' if choices[-1] else ''}); {human_bytes(summary.activation_bytes)} of it are "
            "activations.",
            f"Pass memory_budget >= {human_bytes(low.peak_bytes)} (or {low.peak_bytes} bytes), use more ranks, or "
            "checkpoint activations (checkpoint_activations=True).",
        )
    depth = min(fitting, key=lambda d: (fitting[d][0].prediction.step_s, abs(d - 1)))  # ties: the default, 1
    best, move_reasons = fitting[depth]
    best = planner.fewest_resharded(best)
    if offload is not None:
        reasons.append(f"offload {'on' if offload else 'off'}: as asked")
    elif not reasons:
        reasons.append("offload off: the plan fits on the device" if budget is not None else "offload off: no budget")
    reasons.append(
        f"prefetch {depth}: predicted step "
        + ", ".join(f"{_ms(t[0].prediction.step_s)} with prefetch {d}" + ("" if d in fitting else " (over budget)")
                    for d, t in tried.items())
    )
    reasons.extend(move_reasons or ["units: one per block; no merge or split shortens the predicted step"])
    reasons.extend(_reshard_reasons(summary, best, budget, cost))
    return AutoPlan(summary, best.candidate, best.names, best.prediction, budget, cost, tuple(reasons),
                    _compared(summary, cost, best.candidate.offload))


def _compared(summary: StepSummary, cost: CostInputs, offload: bool) -> tuple[tuple[str, Prediction], ...]:
    starts = _block_starts(summary)
    k = len(starts)
    zero3 = Candidate(starts, (True,) * (k - 1) + (False,), 1, offload)
    zero2 = Candidate(starts, (False,) * k, 1, offload)
    return (("blocks, ZeRO-3, prefetch 1", predict(summary, zero3, cost)),
            ("blocks, ZeRO-2, prefetch 1", predict(summary, zero2, cost)))

