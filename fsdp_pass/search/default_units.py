"""The default units: ``FSDP("zero3")`` without ``units=`` lets the step model choose them.

``units="blocks"`` gives one unit per repeated block; that can be the slow plan (24 layers of d 64 on two gloo
ranks: 2.74x DDP's step, while units of up to 1 MiB step in 0.34x, BENCHMARKS.md). Left out, ``units=`` is
:class:`~fsdp_pass.plan.unit_policies.StepModelUnits`, and the compile turns it into
:class:`~fsdp_pass.plan.unit_policies.ChosenUnits`:

1. When the model is sharded (:func:`settled_units`): the cost inputs are the user's ``cost=``, else the
   defaults of the device the parameters are on (``h100-nvlink`` on CUDA, ``cpu-gloo`` otherwise), the budget
   the CUDA device's memory (no bound on the CPU); with peers, every rank takes rank 0's, so every rank plans
   from the same numbers (a probe or a device's memory could differ between ranks by a little).
2. At the first compile (:func:`choose_units`), from the step summary every rank plans from
   (:mod:`~fsdp_pass.search.planned_from`): only the units are chosen. Strategy, ``reshard_after_forward``, the
   schedule's prefetch depth, checkpointing and offload stay what the user asked, and the step model prices each
   set of units with them. Memory first: FSDP is chosen to save memory, and memory the user did not offer is not
   spent (it may be meant for a larger batch), so the units must predict a peak no higher than one unit per
   block's (nor than the device's memory). Within that, from one unit per block, greedily, each step takes the
   merge of two neighbouring units or the split of a unit at one of its pieces that shortens the predicted step
   most, until none does: merges of small pieces that raise no peak are taken. Moves that together shorten it by
   less than 2 % are given up for one unit per block (the model cannot promise so little). The search is the auto
   planner's: :mod:`fsdp_pass.search.unit_search`; ``FSDP("auto", memory_budget=...)`` spends a budget for speed.
3. Plans the step model cannot price keep one unit per block, with the reason: a schedule that is not a
   prefetch depth (``schedule=None``, ``max_unused_bytes``, ``prefetch_by_unit``), a
   ``reshard_after_forward`` or ``checkpoint_activations`` that is a function of the unit (it reads names the
   merged units would not have).
4. The choice is a pure function of the summary, the options and the settled cost inputs and budget, so the same
   on every rank. The transform keeps the first compile's choice for later compiles of the model (another input
   shape, ``no_sync``), so they do not plan again (:mod:`~fsdp_pass.search.decisions`).

``explain()`` prints the choice and why (:class:`UnitsChoice`): the units, the predicted step and peak against one
unit per block's, and what memory first gave up: the fastest units the search finds without the bound, their step
and peak.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.distributed as dist

from fsdp_pass.cost.candidate_costs import Candidate
from fsdp_pass.cost.cost_model import DEFAULTS, CostInputs, device_defaults
from fsdp_pass.plan.sharding import Strategy
from fsdp_pass.cost.step_model import Prediction, ms, predict
from fsdp_pass.cost.step_summary import StepSummary
from fsdp_pass.plan.options import constant_checkpoint_level
from fsdp_pass.plan.unit_policies import Blocks, ChosenUnits, StepModelUnits
from fsdp_pass.search.last_unit import zero3_reshards
from fsdp_pass.search.unit_search import NO_MOVE, Priced, block_starts, greedy_units, unit_names
from fsdp_pass.text import human_bytes
from fsdp_pass.ranks import has_peers


def settled_units(policy: StepModelUnits, device, group) -> StepModelUnits:
    """``policy`` with the cost inputs and budget filled in from ``device`` (the user's ``cost=`` first), rank 0's
    on every rank of ``group`` (collective, when the group has peers)."""
    default_cost, budget = device_defaults(device)
    chosen = (policy.cost or default_cost, budget)
    if has_peers(group):
        box = [chosen]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        chosen = box[0]
    return StepModelUnits(*chosen, settled=True)


@dataclass(frozen=True)
class UnitsChoice:
    """What the step model chose for ``units=`` left out, and why."""

    names: tuple[str, ...]
    groups: tuple[tuple[str, tuple[str, ...]], ...]  # (unit name, parameter names) per unit, forward order
    cost: CostInputs
    budget: int | None  # the device's memory (None: no bound, the CPU)
    reasons: tuple[str, ...]
    prediction: Prediction | None = None  # None: not priced, one unit per block
    blocks: Prediction | None = None  # one unit per block, priced the same way
    # the fastest units the search finds within the device's memory alone, where they peak above one unit per
    # block (what memory first gave up), and how many units they are
    fastest: Prediction | None = None
    fastest_units: int = 0

    @property
    def kept_blocks(self) -> bool:
        return self.prediction is None or self.prediction == self.blocks

    @property
    def bound(self) -> int | None:
        """The predicted peak the choice keeps within: one unit per block's, or the device's memory if lower."""
        if self.blocks is None:
            return self.budget
        return self.blocks.peak_bytes if self.budget is None else min(self.budget, self.blocks.peak_bytes)

    def memory_first(self) -> str:
        """What keeping within one unit per block's peak traded (memory first: item 2 of the module docstring)."""
        device = "" if self.budget is None else f" (the device's memory: {human_bytes(self.budget)})"
        head = f"memory first: kept within one unit per block's predicted peak, {human_bytes(self.blocks.peak_bytes)}{device}"
        if self.fastest is None:
            return f"{head}; the fastest units found peak no higher"
        return (f"{head}; the fastest units found ({self.fastest_units}) would step in {ms(self.fastest.step_s)} but "
                f"peak at {human_bytes(self.fastest.peak_bytes)} (FSDP('auto', memory_budget=...) spends memory "
                "where it is offered)")

    def __str__(self) -> str:
        named = next((k for k, v in DEFAULTS.items() if v == self.cost), f"cost inputs from {self.cost.source}")
        head = (f"units: chosen by the step model for {named} (units='blocks' gives one per block): "
                f"{len(self.names)} unit(s)")
        if self.prediction is None:
            head = "units: one per block (units='blocks'), the step model could not choose"
        lines = [head]
        if self.prediction is not None:
            lines.append(f"  {', '.join(self.names)}")
            lines.append(f"  predicted step {ms(self.prediction.step_s)} vs blocks {ms(self.blocks.step_s)}, peak "
                         f"{human_bytes(self.prediction.peak_bytes)} vs {human_bytes(self.blocks.peak_bytes)}")
            lines.append(f"  {self.memory_first()}")
            lines.append(f"  cost inputs: {self.cost}")
        lines.extend(f"  {r}" for r in self.reasons)
        return "\n".join(lines)


def _why_not_priced(options) -> str | None:
    """Why the step model cannot price the user's options with other units (None: it can)."""
    s = options.schedule
    if s is None or s.max_unused_bytes is not None or not s.kept_units_first:
        return f"the schedule ({s!r}) is not one the step model follows: a prefetch depth, kept units first"
    if s.prefetch_by_unit:
        return "schedule names units (prefetch_by_unit): merged units would not have those names"
    if not (options.reshard_after_forward is None or isinstance(options.reshard_after_forward, bool)):
        return "reshard_after_forward is a function of the unit: merged units would not have the names it reads"
    if constant_checkpoint_level(options.checkpoint_activations) is None:
        return "checkpoint_activations is a function of the unit: merged units would not have the names it reads"
    return None


def candidate(starts: tuple[int, ...], options, summary: StepSummary) -> Candidate:
    """``starts`` with the user's resharding, prefetch depth, checkpointing and offload (as plan_units applies
    them: ZeRO-3 reshards every unit but the last the forward gathers, that one too where the step model predicts
    a lower step peak for it: :func:`~fsdp_pass.search.last_unit.zero3_reshards`; ZeRO-2 none)."""
    k, override = len(starts), options.reshard_after_forward
    level = constant_checkpoint_level(options.checkpoint_activations)
    out = Candidate(starts, (bool(override),) * k, options.schedule.prefetch, options.offload_to is not None, (),
                    (level,) * k if level != "none" else ())
    if override is None and options.strategy is Strategy.ZERO3:
        out = replace(out, reshard=zero3_reshards(summary, out))
    return out


def _search_reasons(search) -> tuple[str, ...]:
    if search.within_error:
        return (f"kept one unit per block: {search.within_error_text()}",)
    if not search.taken:
        return (f"kept one unit per block: {NO_MOVE}",)
    return ("why, move by move (from one unit per block; each the move that shortened the predicted step most):",
            *(f"  {t.move}: predicted step {ms(t.before.prediction.step_s)} -> {ms(t.after.prediction.step_s)}"
              for t in search.taken))


def choose_units(summary: StepSummary, options, cost: CostInputs, budget: int | None) -> UnitsChoice:
    """The units with the fastest predicted step whose predicted peak is no higher than one unit per block's (nor
    than ``budget``, the device's memory, where that is lower) for the user's other ``options`` (module docstring,
    items 2-3)."""
    blocked = _why_not_priced(options) if summary.pieces else "the step reads no parameters"
    if blocked:
        return UnitsChoice((), (), cost, budget, (f"kept: {blocked}",))
    priced: dict[tuple[int, ...], Priced] = {}  # both searches price many of the same units

    def price(starts: tuple[int, ...]) -> Priced:
        if starts not in priced:
            planned = candidate(starts, options, summary)
            priced[starts] = Priced(planned, predict(summary, planned, cost), tuple(unit_names(summary, starts)))
        return priced[starts]

    blocks = price(block_starts(summary)).prediction
    bound = blocks.peak_bytes if budget is None else min(budget, blocks.peak_bytes)
    search = greedy_units(summary, price, bound)
    fastest = greedy_units(summary, price, budget).chosen  # what the device's memory alone would allow
    spent = fastest.prediction.peak_bytes > search.chosen.prediction.peak_bytes and fastest.prediction.step_s < (
        search.chosen.prediction.step_s)
    chosen = search.chosen
    spans = chosen.candidate.spans(len(summary.pieces))
    groups = tuple((nm, tuple(p for i in s for p in summary.pieces[i].params)) for nm, s in zip(chosen.names, spans))
    return UnitsChoice(chosen.names, groups, cost, budget, _search_reasons(search), chosen.prediction, blocks,
                       fastest.prediction if spent else None, len(fastest.names) if spent else 0)


def units_for(summary: StepSummary, options) -> UnitsChoice:
    """The step model's choice for ``options`` (``units=`` left out) from the step ``summary``, with the settled cost
    inputs and budget (:func:`settled_units`; not settled: the CPU's, no other rank asked)."""
    policy = options.unit_policy
    if not policy.is_settled:
        policy = settled_units(policy, None, None)
    return choose_units(summary, options, policy.cost, policy.budget)


def options_with_units(options, choice: UnitsChoice):
    """``options`` with ``StepModelUnits`` replaced by the ``choice`` (one unit per block where it could not choose)."""
    return replace(options, unit_policy=Blocks() if choice.prediction is None else ChosenUnits(choice.groups))
