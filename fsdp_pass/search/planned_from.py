"""The step every rank plans from: ``agree_on_step(summary, group) -> PlannedFrom``, at the model's first compile.

What a plan decides from the step summary (:mod:`~fsdp_pass.cost.step_summary`) depends on the step's activations,
so on the shape of the batch the step was traced for: the default units (:mod:`~fsdp_pass.search.default_units`),
``FSDP("auto")``'s units, resharding, prefetch depths and checkpointing (:mod:`~fsdp_pass.search.auto_plan`), ZeRO-3's
last unit (:mod:`~fsdp_pass.search.last_unit`, and the byte rule of :mod:`~fsdp_pass.plan.plan_units`). Ranks may feed
batches of different shapes, and ranks that plan differently issue different collectives: a hang on NCCL. So:

1. At the model's first compile (its first call: every rank compiles there), every rank sends its step summary to
   every other: one ``all_gather_object`` over the group of every rank of the model, before any collective of the
   step. Nothing is sent where the group has no peers (one rank; the fake group of a dry run or of the functional
   path).
2. Every rank takes the same one: the summary that holds the most for the backward (:func:`held_for_backward`:
   what the forward keeps, its outputs and the caller's loss on them), the lowest rank among equals. The largest step
   is the safe one to plan from: units, resharding and checkpointing that keep it within memory keep the smaller
   steps within it too, where a plan made for a small batch can overrun a large one. The choice is a pure function of
   the list every rank holds, so it is the same everywhere. Ranks whose first steps read different parameters, or
   in another order, raise the same FSDPError on every rank instead (their models branch on the input).
3. Every decision is made from that summary, so every rank makes the same ones. The compile keeps it
   (``UnitPlan.planned_from``, which ``explain()`` prints), and later compiles of the model plan from it again
   without asking the other ranks: another input shape compiles a variant on one rank alone, where no collective
   is possible. A batch larger than every first one does not change the plan.

The cost inputs and the budget are agreed earlier, when the model is sharded (rank 0's on every rank:
:func:`~fsdp_pass.search.decisions.settle_planning_inputs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from fsdp_pass.errors import fail
from fsdp_pass.cost.step_summary import StepSummary
from fsdp_pass.text import human_bytes
from fsdp_pass.ranks import has_peers


def held_for_backward(summary: StepSummary) -> int:
    """What the step holds for its backward and grows with the batch: the activations its forward keeps, its
    outputs (whose gradients the backward receives), the caller's loss on them and a loss the forward computes."""
    return summary.activation_bytes + summary.output_bytes + summary.loss_bytes + summary.tail_activation_bytes


@dataclass(frozen=True)
class PlannedFrom:
    """The step summary every rank plans from, whose first step it is, and what each rank's first step held for
    its backward (one entry: no other rank was asked)."""

    summary: StepSummary
    rank: int = 0
    held: tuple[int, ...] = ()

    def __str__(self) -> str:
        n = len(self.held)
        if n <= 1:
            return "planned from the first step compiled here (no other rank in the group to agree with)"
        if len(set(self.held)) == 1:
            return (f"planned from rank {self.rank}'s first step: the {n} ranks' first steps hold the same for the "
                    f"backward ({human_bytes(self.held[0])}); every rank plans from it")
        return (f"planned from rank {self.rank}'s first step, which holds the most for the backward of the {n} ranks' "
                f"first steps ({human_bytes(self.held[self.rank])}; the least {human_bytes(min(self.held))}): every "
                "rank plans from it, once, and keeps the plan for later input shapes")


def _params_in_order(summary: StepSummary) -> tuple[tuple[str, ...], ...]:
    return tuple(p.params for p in summary.pieces)


def _names(groups: tuple[tuple[str, ...], ...], i: int) -> str:
    return ", ".join(groups[i]) if i < len(groups) else "nothing"


def _check_same_parameters(summaries: list[StepSummary]) -> None:
    """Every rank's first step reads the same parameters in the same order, or every rank raises the same error."""
    ref = _params_in_order(summaries[0])
    for rank, s in enumerate(summaries[1:], start=1):
        other = _params_in_order(s)
        if other == ref:
            continue
        diff = next((i for i, (a, b) in enumerate(zip(ref, other)) if a != b), min(len(ref), len(other)))
        fail(
            f"The ranks' first steps read different parameters: in the order they read them, rank 0's and rank "
            f"{rank}'s first differ at group #{diff} (rank 0: {_names(ref, diff)}; rank {rank}: {_names(other, diff)}), "
            "so their steps would issue different collectives.",
            "Make every rank's step use the same modules in the same order whatever its input (no branch on the "
            "input's shape or values that skips or adds a layer).",
        )


def agree_on_step(summary: StepSummary, group) -> PlannedFrom:
    """The summary every rank of ``group`` plans from (module docstring); collective where the group has peers."""
    if not has_peers(group):
        return PlannedFrom(summary, 0, (held_for_backward(summary),))
    summaries: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(summaries, summary, group=group)
    _check_same_parameters(summaries)
    held = tuple(held_for_backward(s) for s in summaries)
    rank = max(range(len(held)), key=lambda r: (held[r], -r))
    return PlannedFrom(summaries[rank], rank, held)
