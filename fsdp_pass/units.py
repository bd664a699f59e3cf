"""Unit policies: which parameter uses are gathered together, decided from the forward trace.

A policy sees the parameter uses in trace order and returns groups of parameter names. The
plan then records each unit's first and last use and whether it reshards after forward.
"""

from __future__ import annotations

from fsdp_pass.errors import fail
from fsdp_pass.passes.parameter_args import first_and_last_use
from fsdp_pass.plan import ShardingPlan, Strategy, Unit, UnitPlan

POLICIES = ("per_parameter",)


def _per_parameter(ordered_params: list[str]) -> list[tuple[str, list[str]]]:
    return [(p, [p]) for p in ordered_params]


def plan_units(computation, arg_params: dict[str, str], sharding: ShardingPlan, policy="per_parameter") -> UnitPlan:
    """Group the parameters the forward trace reads into units, in order of first use."""
    uses = first_and_last_use(computation, set(arg_params))
    ordered_args = sorted(uses, key=lambda a: uses[a][0])
    ordered_params = [arg_params[a] for a in ordered_args]
    use_of_param = {arg_params[a]: uses[a] for a in ordered_args}

    if policy == "per_parameter":
        groups = _per_parameter(ordered_params)
    else:
        fail(f"Unknown unit policy {policy!r}.", f"Use one of {POLICIES}.")

    units = []
    for name, members in groups:
        first = min(use_of_param[p][0] for p in members)
        last = max(use_of_param[p][1] for p in members)
        units.append(
            Unit(
                name=name,
                params=tuple(members),
                reshard_after_forward=sharding.strategy is Strategy.ZERO3,
                first_use=first,
                last_use=last,
            )
        )
    units.sort(key=lambda u: u.first_use)
    return UnitPlan(sharding=sharding, units=tuple(units), policy=policy)
