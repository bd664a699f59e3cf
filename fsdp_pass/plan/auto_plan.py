"""The auto planner: units, reshard-after-forward per unit, prefetch depth, activation checkpointing per unit and
offload, chosen to make the predicted step fastest within a memory budget, each decision with its reason.

``plan_step(summary, cost, budget) -> AutoPlan`` is a pure function of a
:class:`~fsdp_pass.plan.step_summary.StepSummary`, :class:`~fsdp_pass.plan.cost_model.CostInputs` and a budget
in bytes (None: no bound). Predictions come from :func:`~fsdp_pass.plan.step_model.predict`.

1. Offload stays off if any plan fits without it; prefetch depths 0, 1 and 2 are each planned, and the
   fastest plan that fits wins, but prefetch 0 only when no deeper prefetch fits: it is a memory measure.
   The model cannot see what it costs where the probe measures no overlap (gloo on shared CPU cores): there
   an exposed gather also waits for the slower rank, and the 22 MiB plan of the README ran 10 % slower
   at prefetch 0 than at 1 (64.5 against 58.5 ms per step on 2 ranks, the same units; docs/units-cost-schedule.md, "The auto plan").
2. For one prefetch depth, start from one unit per block (the ``Blocks`` policy's units) and move greedily:
   at each step try merging every two neighbouring units and splitting every unit at each of its pieces, and
   take the move that shortens the predicted step most; stop when none does. A move that needs more memory
   than the budget gives is taken only with the resharding below. Moves that together shorten the predicted
   step by less than 2 % are given up for one unit per block, when that fits: the model cannot promise so
   little (two gloo ranks on one H100: merging the model into two units for a predicted 1.3 % measured 9 and
   16 % slower than one unit per block, in two runs).
3. For one set of units, keep every unit gathered from its forward to its backward (ZeRO-2, no second
   gather) unless the peak exceeds the budget; then reshard units (ZeRO-3 for them), as few as bring the
   peak within the budget: while searching, the largest first; for the plan chosen, each time the one that
   lowers the peak most, then back to kept each that the budget allows. The last unit the forward gathers
   is never resharded: the backward starts with it, so freeing it would only mean gathering it again.
4. For the plan chosen, give units a prefetch depth of their own (1 or 2; 0 too when the plan's is 0) one at
   a time, each change kept when it shortens the predicted step within the budget; a unit gathered later
   holds its bytes for less time, and that may let resharded units stay gathered (tried after each change).
5. Activation checkpointing (:mod:`~fsdp_pass.plan.auto_checkpoint`) only when no plan fits without it, and
   before offload (which needs the user's ``offload_to``): for a set of units whose peak is over the budget
   with every unit resharded, units checkpoint their activations, selective before full, those that free most
   bytes per recompute second first, as few as fit; for the plan chosen, each unit's level is then stepped down
   wherever the budget allows, before units are kept gathered (step 3). The reasons name each checkpointed
   unit, what it keeps and what its backward recomputes.
6. No plan fits: an FSDPError naming the smallest budget one does (every piece its own unit, all resharded,
   no prefetch, every unit checkpointed, offload on when allowed).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fsdp_pass.errors import check, fail
from fsdp_pass.plan.auto_checkpoint import (
    checkpoint_reasons,
    checkpointed_for_budget,
    fewest_checkpointed,
    moves,
    with_moves,
)
from fsdp_pass.plan.checkpointing import NONE
from fsdp_pass.plan.cost_model import CostInputs
from fsdp_pass.plan.step_model import (
    OPS_PER_COLLECTIVE,
    Candidate,
    Prediction,
    ms,
    peak_of,
    persistent_bytes,
    predict,
    unit_costs,
)
from fsdp_pass.plan.step_summary import StepSummary
from fsdp_pass.report.text import format_table, human_bytes

PREFETCH_DEPTHS = (0, 1, 2)
_BETTER = 1e-3  # a move must shorten the predicted step by this fraction to be taken
_WORTH = 0.02  # all the moves together must shorten it by this fraction to leave one unit per block (item 2)


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


def block_starts(summary: StepSummary) -> tuple[int, ...]:
    return tuple(i for i, p in enumerate(summary.pieces) if i == 0 or p.block != summary.pieces[i - 1].block)


@dataclass(frozen=True)
class _Tried:
    candidate: Candidate
    prediction: Prediction
    names: tuple[str, ...]


class _Planner:
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

        def fits(m: int) -> bool:
            return peak_of(units, flipped(m), names, persistent, self.summary.output_bytes)[0] <= self.budget

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
            candidate = replace(c, reshard=tuple(flags))
            return peak_of(units, candidate, list(t.names), persistent, self.summary.output_bytes)[0]

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

    def kept_where_it_fits(self, c: Candidate, names: tuple[str, ...]) -> _Tried | None:
        """``c`` with each resharded unit kept gathered instead (the smallest first) that the budget allows;
        None when ``c`` itself is over the budget."""
        units = unit_costs(self.summary, c, self.cost)
        persistent = persistent_bytes(self.summary, c.offload)

        def fits(flags) -> bool:
            candidate = replace(c, reshard=tuple(flags))
            return self.budget is None or peak_of(units, candidate, list(names), persistent,
                                                  self.summary.output_bytes)[0] <= self.budget

        flags = list(c.reshard)
        if not fits(flags):
            return None
        for i in sorted((i for i in range(len(flags)) if flags[i]), key=lambda i: units[i].gathered):
            if fits(flags[:i] + [False] + flags[i + 1 :]):
                flags[i] = False
        c = replace(c, reshard=tuple(flags))
        return _Tried(c, predict(self.summary, c, self.cost, list(names)), names)

    def per_unit_depths(self, t: _Tried) -> tuple[_Tried, list[str]]:
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
                    if trial is not None and _fits(trial.prediction, self.budget) and self._better(
                        trial.prediction, now.prediction
                    ):
                        reasons.append(self._depth_reason(i, d, now, trial))
                        now, moved = trial, True
            if not moved:
                break
        c = now.candidate
        if c.depths and all(d == c.prefetch for d in c.depths):
            now = replace(now, candidate=replace(c, depths=()))
        return now, reasons

    def _depth_reason(self, i: int, d: int, old: _Tried, new: _Tried) -> str:
        was = old.candidate.depth_of(i)
        how = ("issued later: its gathered bytes are held for less time" if d < was
               else "issued earlier: more of it hides behind compute")
        fewer = sum(old.candidate.reshard) - sum(new.candidate.reshard)
        kept = f"; {fewer} unit(s) fewer reshard within the budget" if fewer > 0 else ""
        before, after = old.prediction, new.prediction
        return (f"{old.names[i]} prefetch {d} (was {was}): its gather {how}{kept}: predicted step "
                f"{ms(before.step_s)} -> {ms(after.step_s)}, peak {human_bytes(before.peak_bytes)} -> "
                f"{human_bytes(after.peak_bytes)}")

    def tried(self, starts, prefetch: int, offload: bool) -> _Tried:
        candidate = self.reshard_for_budget(tuple(starts), prefetch, offload)
        names = unit_names(self.summary, candidate.starts)
        prediction = predict(self.summary, candidate, self.cost, names)
        if self.checkpointing and not _fits(prediction, self.budget):
            candidate = checkpointed_for_budget(self.summary, candidate, self.cost, self.budget, names)
            prediction = predict(self.summary, candidate, self.cost, names)
        return _Tried(candidate, prediction, tuple(names))

    def fewest_checkpointed(self, t: _Tried) -> _Tried:
        """``t`` with each unit's checkpointing stepped down where the budget allows (auto_checkpoint item 3)."""
        c = fewest_checkpointed(self.summary, t.candidate, self.cost, self.budget, t.names)
        return t if c == t.candidate else _Tried(c, predict(self.summary, c, self.cost, list(t.names)), t.names)

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
        start = now = self.tried(block_starts(self.summary), prefetch, offload)
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
        before, after = start.prediction, now.prediction
        if reasons and _fits(before, self.budget) and after.step_s > before.step_s * (1 - _WORTH):
            return start, [f"units: one per block; the best merges and splits found ({len(reasons)}) predict "
                           f"{ms(before.step_s)} -> {ms(after.step_s)}, less than {_WORTH:.0%} faster: within "
                           "the model's error, not worth the change"]
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
            if self.cost.op_s:
                alpha += f", and {OPS_PER_COLLECTIVE} ops of {self.cost.op_s * 1e6:.3g} us on the host"
            if self.summary.replicas > 1:
                across = self.cost.across_replicas.alpha_s * 1e6
                alpha += f"; an all-reduce fewer across replicas, alpha {across:.3g} us"
            head = (f"{a} and {b} merged: one {human_bytes(ga + gb)} gather instead of {human_bytes(ga)} + "
                    f"{human_bytes(gb)}, a collective fewer each time ({alpha})")
        else:
            head = f"{a} split before {b}: two smaller gathers, the second can overlap the first part's compute"
        if _fits(after, self.budget) and _fits(before, self.budget):
            return f"{head}: predicted step {ms(before.step_s)} -> {ms(after.step_s)}"
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
            fits = "" if _fits(other, self.budget) else ", over the budget"
            lines.append(f"  vs {name}: step {ms(other.step_s)}, peak {human_bytes(other.peak_bytes)}{fits}")
        lines.append("why:")
        lines.extend(f"  {r}" for r in self.reasons)
        return "\n".join(lines)


def _depth_note(d: int, pred: Prediction, fitting: dict, budget: int | None) -> str:
    if d in fitting:
        return ""
    if _fits(pred, budget):
        return " (prefetch 0 only when nothing deeper fits)"
    return " (over budget)"


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
                       f"gathers it again ({ms(u.gather_s)})")
    return out


def smallest_peak(summary: StepSummary, cost: CostInputs, offload: bool = True, checkpoint: bool = True) -> Prediction:
    """The lowest peak any plan reaches: every piece its own unit, all resharded, no prefetch (with ``checkpoint``,
    every unit checkpointed: the lowest of full and selective for each, which is full unless it keeps more)."""
    n = len(summary.pieces)
    finest = Candidate(tuple(range(n)), (True,) * (n - 1) + (False,), 0, offload)
    if checkpoint:
        finest = with_moves(finest, moves(summary, finest, cost))
    return predict(summary, finest, cost)


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
    ``checkpointing``: whether units may checkpoint their activations when nothing fits without."""
    check(len(summary.pieces) > 0, "The step reads no parameters: there is nothing to plan.",
          "Plan a model whose forward reads its parameters.")
    check(budget is None or budget > 0, f"memory_budget={budget!r} is not a positive number of bytes.",
          "Pass e.g. memory_budget='20GiB'.")
    reasons: list[str] = []
    choices = (False, True) if offload is None else (offload,)
    stages = [(off, ckpt) for off in choices for ckpt in ((False, True) if checkpointing else (False,))]
    fitting: dict = {}
    for off, ckpt in stages:  # checkpointing before offload: offload needs the user's offload_to
        planner = _Planner(summary, cost, budget, ckpt)
        tried = {d: planner.units_for(d, off) for d in prefetch_depths}
        fitting = {d: t for d, t in tried.items() if _fits(t[0].prediction, budget)}
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
    if not fitting:
        _no_plan_fits(summary, cost, budget, choices[-1], checkpointing)
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
                    + _depth_note(d, t[0].prediction, fitting, budget) for d, t in tried.items())
    )
    reasons.extend(move_reasons or ["units: one per block; no merge or split shortens the predicted step"])
    reasons.extend(depth_reasons)
    reasons.extend(_reshard_reasons(summary, best, budget, cost))
    if best.candidate.checkpoint:
        without = predict(summary, replace(best.candidate, checkpoint=()), cost, list(best.names)).peak_bytes
        reasons.extend(checkpoint_reasons(summary, best.candidate, cost, best.names, without, budget))
    elif checkpointing and budget is not None:
        reasons.append("no unit checkpoints its activations: the plan fits without")
    return AutoPlan(summary, best.candidate, best.names, best.prediction, budget, cost, tuple(reasons),
                    _compared(summary, cost, best.candidate.offload))


def _no_plan_fits(summary: StepSummary, cost: CostInputs, budget: int, offload: bool, checkpointing: bool):
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
    k = len(starts)
    zero3 = Candidate(starts, (True,) * (k - 1) + (False,), 1, offload)
    zero2 = Candidate(starts, (False,) * k, 1, offload)
    return (("blocks, ZeRO-3, prefetch 1", predict(summary, zero3, cost)),
            ("blocks, ZeRO-2, prefetch 1", predict(summary, zero2, cost)))

