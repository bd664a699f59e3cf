"""Plan the units of one forward trace: ``plan_units(trace, ...) -> UnitPlan``, before any rewriting.

1. Find where the trace first and last reads each parameter.
2. Ask the unit policy (:mod:`fsdp_pass.plan.unit_policies`) for groups of parameter names.
3. Split a group that mixes dtypes into one unit per dtype (one flat buffer needs one dtype).
4. Decide per unit whether it reshards after forward: ``reshard_after_forward`` where the user gave it, else
   ZeRO-2 never and ZeRO-3 every unit. Whether ZeRO-3's last unit stays gathered into the backward is a search
   step after this one (:mod:`~fsdp_pass.search.reshard_last_unit`).
5. Order units by first use; that is the order of their all-gathers.
6. Mark the units whose activations are checkpointed, and at which level (``checkpoint_activations``, asked per
   unit: :mod:`~fsdp_pass.plan.checkpointing`).
"""

from __future__ import annotations

from dataclasses import replace

from fsdp_pass.errors import check
from fsdp_pass.plan.checkpointing import checkpoint_level
from fsdp_pass.plan.module_tree import ModuleTree
from fsdp_pass.plan.options import FSDPOptions
from fsdp_pass.plan.sharding import ShardingPlan, Strategy
from fsdp_pass.plan.trace_arguments import first_and_last_use
from fsdp_pass.plan.unit_policies import PolicyInput
from fsdp_pass.plan.units import Unit, UnitPlan

_DTYPE_SHORT = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float64": "fp64"}


def _short(dtype) -> str:
    return _DTYPE_SHORT.get(str(dtype), str(dtype).replace("torch.", ""))


def _split_by_dtype(groups, sharding: ShardingPlan, notes: list[str]):
    out = []
    for name, params in groups:
        by_dtype: dict = {}
        for p in params:
            by_dtype.setdefault(sharding.param(p).dtype, []).append(p)
        if len(by_dtype) == 1:
            out.append((name, tuple(params)))
            continue
        notes.append(
            f"unit {name!r} mixes dtypes ({', '.join(_short(d) for d in by_dtype)}): split into one unit per dtype"
        )
        out.extend((f"{name}[{_short(d)}]", tuple(ps)) for d, ps in by_dtype.items())
    return out


def _reshard(units: list[Unit], sharding: ShardingPlan, options: FSDPOptions) -> list[Unit]:
    """Each unit's resharding after forward: the user's ``reshard_after_forward``, else ZeRO-2 none and ZeRO-3
    every unit (the last one the forward gathers is decided after, by
    :func:`~fsdp_pass.search.reshard_last_unit.reshard_last_unit`)."""
    override = options.reshard_after_forward
    if override is None:
        flags = [sharding.strategy is Strategy.ZERO3] * len(units)
    elif isinstance(override, bool):
        flags = [override] * len(units)
    else:
        check(callable(override), f"reshard_after_forward={override!r} is not a bool or a function of a unit.",
              "Pass None (the strategy decides), True, False, or a function Unit -> bool.")
        flags = [bool(override(u)) for u in units]
    return [replace(u, reshard_after_forward=f) for u, f in zip(units, flags)]


def policy_input(computation, param_of_arg: dict[str, str], sharding: ShardingPlan, tree: ModuleTree | None):
    """What a unit policy sees: the tree, the parameters in order of first use, their uses and sizes."""
    uses_of_arg = first_and_last_use(computation, set(param_of_arg))
    uses = {param_of_arg[a]: u for a, u in uses_of_arg.items()}
    order = tuple(sorted(uses, key=lambda p: uses[p][0]))
    return PolicyInput(
        tree=tree if tree is not None else ModuleTree.flat(p.name for p in sharding.params),
        order=order,
        first_use={p: uses[p][0] for p in order},
        nbytes={p: sharding.param(p).nbytes() for p in order},
    ), uses


def plan_units(
    computation,
    param_of_arg: dict[str, str],
    sharding: ShardingPlan,
    options: FSDPOptions,
    tree: ModuleTree | None = None,
) -> UnitPlan:
    """Group the parameters the forward trace reads into units, in order of first use.

    ``param_of_arg``: the trace's parameter arguments (:func:`~fsdp_pass.plan.trace_arguments.parameter_names_of_args`);
    ``tree``: the module tree the policy reads (without it every parameter hangs off the root). Under ZeRO-3 every
    unit reshards after forward here; the pipeline then decides the last one
    (:func:`~fsdp_pass.search.reshard_last_unit.reshard_last_unit`).
    """
    policy = options.unit_policy
    inp, uses = policy_input(computation, param_of_arg, sharding, tree)
    groups = policy.groups(inp)
    placed = [p for _, ps in groups for p in ps]
    check(sorted(placed) == sorted(inp.order),
          f"Unit policy {type(policy).__name__} did not place every used parameter exactly once.",
          "A custom policy's groups() must return each parameter of PolicyInput.order in one group.")
    notes: list[str] = []
    unused = [s.name for s in sharding.params if s.name not in uses]
    if unused:
        notes.append(f"{len(unused)} parameter(s) not read by this forward, never gathered: {', '.join(unused[:4])}"
                     + (", ..." if len(unused) > 4 else ""))

    units = [
        Unit(name, params, False, min(uses[p][0] for p in params), max(uses[p][1] for p in params))
        for name, params in _split_by_dtype(groups, sharding, notes)
    ]
    units.sort(key=lambda u: u.first_use)
    levels = [checkpoint_level(options.checkpoint_activations(u)) for u in units]
    units = _reshard(units, sharding, options)
    units = [replace(u, checkpoint=level) for u, level in zip(units, levels)]
    return UnitPlan(
        sharding=sharding,
        units=tuple(units),
        policy=getattr(policy, "name", type(policy).__name__),
        notes=tuple(notes),
        arguments=tuple((getattr(a, "name", None), param_of_arg.get(getattr(a, "name", None))) for a in computation.args),
    )
