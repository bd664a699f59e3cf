"""The unit plan: the FSDP units of one forward trace, each a group of parameter uses gathered with one
all-gather and reduced with one reduce-scatter. Made from the functional forward trace
(:func:`~fsdp_pass.plan.plan_units.plan_units`); frozen, and printable as a table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fsdp_pass.plan.sharding import ShardingPlan
from fsdp_pass.text import format_table, human_bytes


@dataclass(frozen=True)
class Unit:
    """An FSDP unit: parameter uses that are gathered, used and released together."""

    name: str
    params: tuple[str, ...]  # parameter names, in the order they sit in the flat buffer
    reshard_after_forward: bool  # ZeRO-3 for this unit: gather again in the backward
    first_use: int = -1  # index of the first forward op that reads one of the params
    last_use: int = -1
    # its activations recomputed in the backward instead of saved: "none", "selective" (all but its matmuls and
    # attentions), "full" (plan.checkpointing)
    checkpoint: str = "none"

    @property
    def checkpointed(self) -> bool:
        return self.checkpoint != "none"


@dataclass(frozen=True)
class UnitPlan:
    """The units of one forward trace, in the order their all-gathers are issued."""

    sharding: ShardingPlan
    units: tuple[Unit, ...]
    policy: str = "per_parameter"
    notes: tuple[str, ...] = field(default=())
    # the forward trace's arguments in order: (argument name, the parameter it is, or None)
    arguments: tuple[tuple[str | None, str | None], ...] = ()
    auto: object | None = None  # FSDP("auto"): the AutoPlan these units come from, with its reasons
    # units= left out: the step model's choice of units, with its reasons (a search.default_units.UnitsChoice)
    units_choice: object | None = None
    # the step model's view of the trace (a cost.step_summary.StepSummary): what cost.price_plan prices any plan from
    summary: object | None = None
    # the step summary every rank planned from, and whose first step it is (a search.planned_from.PlannedFrom): what
    # the plan's decisions read, the same at every compile of the model
    planned_from: object | None = None
    # the FSDPOptions stages 1-3 planned with, where no CompiledStep keeps them beside the plan (the functional path:
    # derive_backward_and_lower schedules with them, the auto plan's prefetch depths included)
    options: object | None = None

    @property
    def param_of_arg(self) -> dict[str, str]:
        """Argument name -> parameter name, for the arguments that are parameters."""
        return {arg: param for arg, param in self.arguments if param is not None}

    @property
    def arg_order(self) -> list[str | None]:
        """The forward's argument names in order (position ``i`` of the backward's return is their gradient)."""
        return [arg for arg, _ in self.arguments]

    @property
    def unit_named(self) -> dict[str, Unit]:
        """Unit name -> unit."""
        return {u.name: u for u in self.units}

    @property
    def checkpointed(self) -> tuple[str, ...]:
        """Names of the units whose activations are recomputed in the backward."""
        return tuple(u.name for u in self.units if u.checkpointed)

    def unit_numel(self, unit: Unit) -> tuple[int, int, int]:
        """(unsharded numel, sharded numel per rank, padding numel) of ``unit``."""
        specs = [self.sharding.param(n) for n in unit.params]
        return (
            sum(s.layout.numel for s in specs),
            sum(s.layout.shard_numel for s in specs),
            sum(s.layout.padding_numel for s in specs),
        )

    def unit_itemsize(self, unit: Unit) -> int:
        return self.sharding.param(unit.params[0]).itemsize

    def __str__(self) -> str:
        sp = self.sharding
        head = (
            f"FSDP plan: strategy={sp.strategy.value} world_size={sp.world_size} "
            f"units={len(self.units)} policy={self.policy}"
        )
        cols = ("unit", "params", "numel", "sharded/rank", "unsharded", "padding", "first..last use", "reshard")
        rows = []
        for u in self.units:
            numel, shard_numel, pad = self.unit_numel(u)
            b = self.unit_itemsize(u)
            params = ", ".join(u.params)
            rows.append(
                (
                    u.name,
                    params if len(params) <= 60 else params[:57] + "...",
                    f"{numel:,}",
                    human_bytes(shard_numel * b),
                    human_bytes(shard_numel * b * sp.world_size),
                    f"{pad:,}",
                    f"{u.first_use}..{u.last_use}",
                    "yes" if u.reshard_after_forward else "no",
                )
            )
        lines = [head, *format_table(cols, rows)]
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)
