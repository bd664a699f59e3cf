"""The sharding plan: every parameter name of the module, with how it is sharded at this world size.

Made when the transform is applied to the module (no trace yet): one :class:`ParamSpec` per parameter
name, with its dim-0 :class:`~fsdp_pass.plan.layout.ShardLayout`, and the :class:`Strategy`. Frozen,
and built without a process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from fsdp_pass.errors import fail
from fsdp_pass.plan.layout import ShardLayout


class Strategy(Enum):
    """ZeRO-2 keeps gathered parameters from forward to backward; ZeRO-3 frees them and gathers again."""

    ZERO2 = "zero2"
    ZERO3 = "zero3"


def parse_strategy(strategy: "Strategy | str", also: tuple[str, ...] = ()) -> Strategy:
    """The :class:`Strategy` a name or member names; else an FSDPError listing the names, with ``also`` (names
    the caller accepted before asking, e.g. ``FSDP``'s ``"auto"``)."""
    if isinstance(strategy, Strategy):
        return strategy
    if isinstance(strategy, str):
        for s in Strategy:
            if s.value == strategy.lower() or s.name == strategy.upper():
                return s
    fail(
        f"Unknown FSDP strategy {strategy!r}.",
        f"Pass one of {[s.value for s in Strategy] + list(also)} (or fsdp_pass.Strategy.ZERO2 / Strategy.ZERO3).",
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

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        """The whole (unsharded) parameter's bytes in ``dtype``, e.g. as mixed precision gathers it (None: its own)."""
        return self.layout.numel * (self.itemsize if dtype is None else dtype.itemsize)

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
