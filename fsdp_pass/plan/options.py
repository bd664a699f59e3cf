"""The options of one ``FSDP(...)``, checked and frozen: what the stages of the pipeline read.

``FSDPOptions.resolve(strategy, units=..., ...)`` turns what a user may pass (``"zero3"``, ``"blocks"``, a
list of modules, an int prefetch depth, a bare dtype, a bool) into one frozen record; a bad value raises
an ``FSDPError`` that says what to pass instead. The functional (tutorial) path builds the same record.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Callable

from fsdp_pass.errors import check
from fsdp_pass.plan.mixed_precision import FULL_PRECISION, MixedPrecision, resolve_mixed_precision
from fsdp_pass.plan.schedule import DEFAULT_SCHEDULE, Schedule, resolve_schedule
from fsdp_pass.plan.sharding import Strategy, parse_strategy
from fsdp_pass.plan.unit_policies import Blocks, resolve_policy
from fsdp_pass.plan.units import Unit


def _never(unit: Unit) -> bool:
    return False


def _always(unit: Unit) -> bool:
    return True


def checkpoint_predicate(spec) -> Callable[[Unit], bool]:
    """``checkpoint_activations=``: a bool, or a function ``Unit -> bool``."""
    if isinstance(spec, bool):
        return _always if spec else _never
    check(
        callable(spec),
        f"checkpoint_activations={spec!r} is neither a bool nor a function of a unit.",
        "Pass True (every unit), False, or a function Unit -> bool, e.g. lambda u: u.name.startswith('layers.').",
    )
    return spec


DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


def resolve_timeout(timeout) -> datetime.timedelta:
    """``timeout=``: seconds or a ``timedelta``, more than zero."""
    ok = isinstance(timeout, datetime.timedelta) or (isinstance(timeout, (int, float)) and not isinstance(timeout, bool))
    value = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout if ok else 0)
    check(
        ok and value.total_seconds() > 0,
        f"timeout={timeout!r} is not a positive number of seconds or a datetime.timedelta.",
        "Pass e.g. timeout=120 (seconds) or timeout=datetime.timedelta(minutes=2).",
    )
    return value


@dataclass(frozen=True)
class FSDPOptions:
    """Everything of ``FSDP(...)`` that decides what the passes write (see :class:`fsdp_pass.FSDP`)."""

    strategy: Strategy = Strategy.ZERO2
    unit_policy: object = field(default_factory=Blocks)  # groups parameters into units (plan.unit_policies)
    reshard_after_forward: bool | Callable[[Unit], bool] | None = None  # None: the strategy decides
    schedule: Schedule | None = DEFAULT_SCHEDULE  # None: Thunder's order
    checkpoint_activations: Callable[[Unit], bool] = _never
    mixed_precision: MixedPrecision = FULL_PRECISION
    offload_to: str | None = None  # where shards, their gradients and the optimizer state live between uses
    verify_ranks: bool = True  # check at every step that every rank issues the same collectives
    timeout: datetime.timedelta = DEFAULT_TIMEOUT  # how long a collective helper waits for every rank to arrive

    @classmethod
    def resolve(
        cls,
        strategy: Strategy | str = Strategy.ZERO2,
        *,
        units="blocks",
        reshard_after_forward=None,
        schedule=DEFAULT_SCHEDULE,
        checkpoint_activations=False,
        mixed_precision=None,
        offload_to=None,
        verify_ranks: bool = True,
        timeout=DEFAULT_TIMEOUT,
    ) -> FSDPOptions:
        """The options from what a user passes to ``FSDP(...)``."""
        return cls(
            parse_strategy(strategy),
            resolve_policy(units),
            reshard_after_forward,
            resolve_schedule(schedule),
            checkpoint_predicate(checkpoint_activations),
            resolve_mixed_precision(mixed_precision),
            None if offload_to is None else str(offload_to),
            bool(verify_ranks),
            resolve_timeout(timeout),
        )
