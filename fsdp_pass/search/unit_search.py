"""The greedy search over units that the auto planner (:mod:`fsdp_pass.search.auto_plan`) and the default units
(:mod:`fsdp_pass.search.default_units`) share.

``greedy_units(summary, price, budget) -> UnitSearch`` is a pure function of a
:class:`~fsdp_pass.cost.step_summary.StepSummary`, a ``price(starts) -> Priced`` (the caller's: which units
reshard, prefetch, checkpoint, and so the predicted step of each set of units) and a budget in bytes (None: no
bound). Units are runs of the summary's pieces, named by where each starts (``starts``).

1. Start from one unit per block (the ``Blocks`` policy's units).
2. Each step tries merging every two neighbouring units and splitting every unit at each of its pieces, and
   takes the move whose predicted step is shortest among those that fit the budget (while none fits: whose
   peak is lowest); the move is taken when it shortens the predicted step by 0.1 % (while nothing fits:
   lowers the peak, or brings it within the budget). The search stops when no move is taken.
3. Moves that together shorten the predicted step by less than 2 % are given up for one unit per block, when
   that fits (:attr:`UnitSearch.within_error`): the model cannot promise so little (two gloo ranks on one
   H100: merging the model into two units for a predicted 1.3 % measured 9 and 16 % slower than one unit per
   block, in two runs).

The callers word the moves their own way: the auto planner with what each merge saves, the default units with
the predicted step alone (:class:`Taken` keeps both sides of each move).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fsdp_pass.cost.candidate_costs import Candidate
from fsdp_pass.cost.step_model import Prediction, ms
from fsdp_pass.cost.step_summary import StepSummary

BETTER = 1e-3  # a move must shorten the predicted step by this fraction to be taken
WORTH = 0.02  # all the moves together must shorten it by this fraction to leave one unit per block (item 3)
NO_MOVE = "no merge or split shortens the predicted step"


def fits(pred: Prediction, budget: int | None) -> bool:
    """Whether the predicted peak is within ``budget`` (None: no bound)."""
    return budget is None or pred.peak_bytes <= budget


def rank(pred: Prediction, budget: int | None) -> tuple:
    """Smaller is better: plans that fit first, by step time; the others by peak."""
    return (0, pred.step_s) if fits(pred, budget) else (1, pred.peak_bytes)


def better(new: Prediction, old: Prediction, budget: int | None) -> bool:
    """Whether ``new`` is worth a change from ``old``: it fits where ``old`` does not; both over the budget, a
    lower peak; both within it, a step shorter by :data:`BETTER`."""
    if fits(new, budget) != fits(old, budget):
        return fits(new, budget)
    if not fits(new, budget):
        return new.peak_bytes < old.peak_bytes
    return new.step_s < old.step_s * (1 - BETTER)


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
    """One unit per block: the index of each block's first piece."""
    return tuple(i for i, p in enumerate(summary.pieces) if i == 0 or p.block != summary.pieces[i - 1].block)


@dataclass(frozen=True)
class Priced:
    """A set of units as the caller plans it (``candidate.starts``), with its prediction and unit names."""

    candidate: Candidate
    prediction: Prediction
    names: tuple[str, ...]


@dataclass(frozen=True)
class Move:
    """The merge of ``unit`` with the unit after it, ``other``, or the split of ``unit`` before its piece
    ``other``; ``starts``: the units after the move."""

    kind: str  # "merge" or "split"
    unit: str
    other: str
    starts: tuple[int, ...]

    def __str__(self) -> str:
        if self.kind == "merge":
            return f"{self.unit} and {self.other} merged"
        return f"{self.unit} split before {self.other}"


@dataclass(frozen=True)
class Taken:
    """A move the search took: the units before and after it."""

    move: Move
    before: Priced
    after: Priced


@dataclass(frozen=True)
class UnitSearch:
    """Where the greedy search started (one unit per block), where its moves ended, and the moves."""

    blocks: Priced
    found: Priced
    taken: tuple[Taken, ...]
    budget: int | None

    @property
    def within_error(self) -> bool:
        """The moves shorten the predicted step by less than :data:`WORTH`, and one unit per block fits."""
        before, after = self.blocks.prediction, self.found.prediction
        return bool(self.taken) and fits(before, self.budget) and after.step_s > before.step_s * (1 - WORTH)

    @property
    def chosen(self) -> Priced:
        """The units the search gives: one unit per block when the moves are within the model's error."""
        return self.blocks if self.within_error else self.found

    def within_error_text(self) -> str:
        """Why one unit per block stays (when :attr:`within_error`)."""
        before, after = self.blocks.prediction, self.found.prediction
        return (f"the best merges and splits found ({len(self.taken)}) predict {ms(before.step_s)} -> "
                f"{ms(after.step_s)}, less than {WORTH:.0%} faster: within the model's error")


def unit_moves(summary: StepSummary, starts: tuple[int, ...]):
    """Every merge of two neighbouring units and every split of a unit at one of its pieces."""
    n = len(summary.pieces)
    names = unit_names(summary, starts)
    for u in range(1, len(starts)):
        yield Move("merge", names[u - 1], names[u], starts[:u] + starts[u + 1:])
    for u, (a, b) in enumerate(zip(starts, (*starts[1:], n))):
        for cut in range(a + 1, b):
            yield Move("split", names[u], summary.pieces[cut].name, tuple(sorted((*starts, cut))))


def greedy_units(summary: StepSummary, price: Callable[[tuple[int, ...]], Priced], budget: int | None) -> UnitSearch:
    """The greedy search from one unit per block (module docstring)."""
    start = now = price(block_starts(summary))
    taken: list[Taken] = []
    for _ in range(4 * len(summary.pieces)):
        best = None
        for move in unit_moves(summary, now.candidate.starts):
            priced = price(move.starts)
            if best is None or rank(priced.prediction, budget) < rank(best[1].prediction, budget):
                best = (move, priced)
        if best is None or not better(best[1].prediction, now.prediction, budget):
            break
        taken.append(Taken(best[0], now, best[1]))
        now = best[1]
    return UnitSearch(start, now, tuple(taken), budget)
