"""The plan: what is sharded, how, and which parameters travel together. Frozen and printable.

Two layers, built at two moments:

1. :class:`ShardingPlan` is made when the transform is applied to the module (no trace yet): one
   :class:`ParamSpec` per parameter name, with its dim-0 :class:`~fsdp_pass.layout.ShardLayout`.
2. :class:`UnitPlan` is made from the functional forward trace: the FSDP units, each a group of
   parameter uses gathered with one all-gather and reduced with one reduce-scatter.

Both can be built and printed without a process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from fsdp_pass.errors import fail
from fsdp_pass.layout import ShardLayout


class Strategy(Enum):
    """ZeRO-2 keeps gathered parameters from forward to backward; ZeRO-3 frees them and gathers again."""

    ZERO2 = "zero2"
    ZERO3 = "zero3"


def parse_strategy(strategy: "Strategy | str") -> Strategy:
    if isinstance(strategy, Strategy):
        return strategy
    if isinstance(strategy, str):
        for s in Strategy:
            if s.value == strategy.lower() or s.name == strategy.upper():
                return s
    fail(
        f"Unknown FSDP strategy {strategy!r}.",
        f"Pass one of {[s.value for s in Strategy]} (or fsdp_pass.Strategy.ZERO2 / Strategy.ZERO3).",
    )


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def format_table(cols, rows) -> list[str]:
    """A header, a dashed rule and one line per row, each column left-aligned to its widest cell."""
    rows = [tuple(str(v) for v in r) for r in rows]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*line).rstrip() for line in [cols, ["-" * w for w in widths], *rows]]


def collective_label(unit_name: str, kind: str, n_params: int, shard_bytes: int, world_size: int, padding: int) -> str:
    """The header every inserted collective carries in the printed traces."""
    return (
        f"[fsdp] unit {unit_name!r} {kind}: {n_params} param(s), "
        f"{human_bytes(shard_bytes)}/rank x {world_size} = {human_bytes(shard_bytes * world_size)}"
        + (f", {padding:,} padding elements" if padding else "")
    )


@dataclass(frozen=True)
class ParamSpec:
    """One parameter name of the module and the sharded tensor that backs it."""

    name: str
    shard_of: str  # the name whose shard this name reads; itself unless tied to an earlier name
    layout: ShardLayout
    dtype: torch.dtype
    requires_grad: bool

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def is_tied(self) -> bool:
        return self.shard_of != self.name


@dataclass(frozen=True)
class ShardingPlan:
    """Every parameter name of the module, with how it is sharded at this world size."""

    world_size: int
    rank: int
    strategy: Strategy
    params: tuple[ParamSpec, ...]

    def __post_init__(self):
        object.__setattr__(self, "_by_name", {p.name: p for p in self.params})

    def param(self, name: str) -> ParamSpec:
        return self._by_name[name]

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def owners(self) -> tuple[ParamSpec, ...]:
        """One spec per sharded tensor (tied names left out)."""
        return tuple(p for p in self.params if not p.is_tied)


@dataclass(frozen=True)
class Unit:
    """An FSDP unit: parameter uses that are gathered, used and released together."""

    name: str
    params: tuple[str, ...]  # parameter names, in the order they sit in the flat buffer
    reshard_after_forward: bool  # ZeRO-3 for this unit: gather again in the backward
    first_use: int = -1  # index of the first forward op that reads one of the params
    last_use: int = -1


@dataclass(frozen=True)
class UnitPlan:
    """The units of one forward trace, in the order their all-gathers are issued."""

    sharding: ShardingPlan
    units: tuple[Unit, ...]
    policy: str = "per_parameter"
    notes: tuple[str, ...] = field(default=())

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
