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
from fsdp_pass.plan.checkpointing import FULL, LEVELS, NONE, checkpoint_level
from fsdp_pass.cost.cost_model import DEFAULTS, CostInputs
from fsdp_pass.plan.optimizers import ADAMW, Optimizer, resolve_optimizer
from fsdp_pass.plan.mixed_precision import FULL_PRECISION, MixedPrecision, resolve_mixed_precision
from fsdp_pass.plan.schedule import DEFAULT_SCHEDULE, Schedule, resolve_schedule
from fsdp_pass.plan.sharding import Strategy, parse_strategy
from fsdp_pass.plan.unit_policies import Blocks, StepModelUnits, resolve_policy
from fsdp_pass.plan.units import Unit


def _never(unit: Unit) -> bool:
    return False


def _always(unit: Unit) -> bool:
    return True


@dataclass(frozen=True)
class _Every:
    level: str

    def __call__(self, unit: Unit) -> str:
        return self.level


def constant_checkpoint_level(predicate) -> str | None:
    """The level ``checkpoint_activations`` gives every unit (``"none"`` included), None for a user's function of
    the unit (what the default units' step model cannot price: :mod:`fsdp_pass.search.default_units`)."""
    if predicate is _never:
        return NONE
    if predicate is _always:
        return FULL
    return predicate.level if isinstance(predicate, _Every) else None


def checkpoint_predicate(spec) -> Callable[[Unit], bool | str]:
    """``checkpoint_activations=``: a bool, a level (``"selective"``, ``"full"``: plan.checkpointing) for every
    unit, or a function ``Unit -> bool or level``."""
    if isinstance(spec, bool):
        return _always if spec else _never
    check(
        callable(spec) or (isinstance(spec, str) and spec.lower() in LEVELS),
        f"checkpoint_activations={spec!r} is neither a bool, a level nor a function of a unit.",
        "Pass True (every unit, full), 'selective' (every unit keeps its matmuls' results), False, or a function "
        "Unit -> bool or level, e.g. lambda u: u.name.startswith('layers.').",
    )
    return _Every(checkpoint_level(spec)) if isinstance(spec, str) else spec


def resolve_check_finite(check_finite) -> bool:
    """``check_finite=``: a bool."""
    check(
        isinstance(check_finite, bool),
        f"check_finite={check_finite!r} is not a bool.",
        "Pass check_finite=True to check every unit's parameters, outputs and gradients for NaN/inf at every step, "
        "or leave it out (False: no check, no cost).",
    )
    return check_finite


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
class AutoSettings:
    """``FSDP("auto", memory_budget=..., cost=..., optimizer=...)``: what the auto planner (:mod:`fsdp_pass.search.auto_plan`)
    plans with. ``cost`` None: the defaults of the device the step computes on."""

    memory_budget: int | None = None  # bytes per rank; None: the device's memory (no bound on the CPU)
    cost: CostInputs | None = None
    optimizer: Optimizer = ADAMW  # what steps the shards: its states and its time (plan.optimizers)


def parse_bytes(value) -> int | None:
    """``"20GiB"``, ``"512 MiB"``, ``"1.5GB"``, or a number of bytes -> bytes; None stays None."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    units = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
    text = str(value).strip().lower().replace(" ", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    try:
        size = float(number) * units[text[len(number):]]
    except (KeyError, ValueError):
        size = 0
    check(size > 0, f"{value!r} is not a size in bytes.", "Pass e.g. '20GiB', '512MiB', '1.5GB' or a number of bytes.")
    return int(size)


def resolve_cost(cost) -> CostInputs | None:
    """``cost=``: None (the device's defaults), a name in ``cost_model.DEFAULTS``, CostInputs, or a probe result."""
    if cost is None or isinstance(cost, CostInputs):
        return cost
    if isinstance(cost, str):
        check(cost in DEFAULTS, f"Unknown cost inputs {cost!r}.",
              f"Pass one of {sorted(DEFAULTS)}, or fsdp_pass.cost.probe.probe(...).cost measured on your ranks.")
        return DEFAULTS[cost]
    check(isinstance(getattr(cost, "cost", None), CostInputs), f"Cannot read {cost!r} as cost inputs.",
          f"Pass one of {sorted(DEFAULTS)}, a CostInputs, or what fsdp_pass.cost.probe.probe(...) returns.")
    return cost.cost


@dataclass(frozen=True)
class FSDPOptions:
    """Everything of ``FSDP(...)`` that decides what the passes write (see :class:`fsdp_pass.FSDP`)."""

    strategy: Strategy = Strategy.ZERO2
    unit_policy: object = field(default_factory=Blocks)  # groups parameters into units (plan.unit_policies)
    reshard_after_forward: bool | Callable[[Unit], bool] | None = None  # None: the strategy decides
    schedule: Schedule | None = DEFAULT_SCHEDULE  # None: Thunder's order
    checkpoint_activations: Callable[[Unit], bool | str] = _never
    mixed_precision: MixedPrecision = FULL_PRECISION
    offload_to: str | None = None  # where shards, their gradients and the optimizer state live between uses
    verify_ranks: bool = True  # check at every step that every rank issues the same collectives
    timeout: datetime.timedelta = DEFAULT_TIMEOUT  # how long a collective helper waits for every rank to arrive
    auto: AutoSettings | None = None  # FSDP("auto"): units, resharding, prefetch and offload are planned
    check_finite: bool = False  # NaN/inf checks per unit in the step's traces (ops.finite_checks)

    @classmethod
    def resolve(
        cls,
        strategy: Strategy | str = Strategy.ZERO2,
        *,
        units=None,
        reshard_after_forward=None,
        schedule=DEFAULT_SCHEDULE,
        checkpoint_activations=False,
        mixed_precision=None,
        offload_to=None,
        verify_ranks: bool = True,
        timeout=DEFAULT_TIMEOUT,
        memory_budget=None,
        cost=None,
        check_finite: bool = False,
        optimizer=None,
    ) -> FSDPOptions:
        """The options from what a user passes to ``FSDP(...)``."""
        auto = None
        if isinstance(strategy, str) and strategy.lower() == "auto":
            chosen = [name for name, value, default in (
                ("units", None if units == "blocks" else units, None), ("reshard_after_forward", reshard_after_forward, None),
                ("schedule", schedule, DEFAULT_SCHEDULE), ("checkpoint_activations", checkpoint_activations, False))
                if value is not default and value != default]
            check(not chosen, f"FSDP('auto') chooses {', '.join(chosen)} itself, and they were passed too.",
                  "Leave them out (the plan and its reasons print with fsdp_pass.explain(model)), or pass "
                  "'zero2'/'zero3' to choose them by hand.")
            strategy, auto = "zero3", AutoSettings(parse_bytes(memory_budget), resolve_cost(cost),
                                                   resolve_optimizer(optimizer))
        else:
            check(memory_budget is None and optimizer is None and (cost is None or units is None),
                  "memory_budget= and optimizer= are read by the auto planner only, cost= by it and by the step "
                  "model that chooses the units when units= is left out.",
                  "Pass FSDP('auto', memory_budget='20GiB', optimizer='sgd'), or leave them out (or units=).")
        policy = StepModelUnits(resolve_cost(cost)) if units is None and auto is None else resolve_policy(
            "blocks" if units is None else units)
        return cls(
            parse_strategy(strategy, also=("auto",)),
            policy,
            reshard_after_forward,
            resolve_schedule(schedule),
            checkpoint_predicate(checkpoint_activations),
            resolve_mixed_precision(mixed_precision),
            None if offload_to is None else str(offload_to),
            bool(verify_ranks),
            resolve_timeout(timeout),
            auto,
            resolve_check_finite(check_finite),
        )
