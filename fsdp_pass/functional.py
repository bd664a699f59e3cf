"""The pass, step by step, on a functional trace in one process (what the notebooks do).

    with fake_process_group(8) as group:
        prologue, trace = functional_trace(model, x)                   # 1. Thunder's functional forward
        sharded, plan = shard_functional_trace(prologue, trace, group, "zero3", model=model)  # 2-3.
        forward, backward = derive_backward_and_lower(sharded)          # 4-6. autodiff, lowering, schedule

No module is changed and nothing is communicated: the traces show what every rank would run.
"""

from __future__ import annotations

import thunder
import torch.distributed as dist

from fsdp_pass.errors import check
from fsdp_pass.plan.layout import ShardLayout
from fsdp_pass.plan.module_tree import ModuleTree
from fsdp_pass.passes.insert_unshards import insert_unshards
from fsdp_pass.plan.trace_arguments import parameter_names_of_args
from fsdp_pass.passes.schedule_collectives import schedule_collectives
from fsdp_pass.plan.sharding import ParamSpec, ShardingPlan, parse_strategy
from fsdp_pass.plan.units import UnitPlan
from fsdp_pass.plan.schedule import DEFAULT_SCHEDULE, Schedule
from fsdp_pass.plan.plan_units import plan_units


def functional_trace(model, *args, **kwargs):
    """Thunder's prologue and functional forward trace of ``model(*args)`` (the trace transforms receive)."""
    jm = thunder.jit(model)
    cache_entry, _, _ = thunder.compile_data(jm).get_computation_and_inputs(*args, **kwargs)
    traces = cache_entry.computation_traces
    (trace,) = [t for t in traces if "Remove context manager prims" in str(t.get_provenance())]
    return cache_entry.prologue_traces[0], trace


def shard_functional_trace(
    prologue, computation, group, strategy="zero2", units="blocks", model=None, reshard_after_forward=None
):
    """Shard the parameter arguments of ``computation`` and insert the unit gathers: (trace, UnitPlan).

    ``model`` (the module the trace came from) lets the unit policy see the module tree; without it
    every parameter hangs off the root.
    """
    check(
        dist.is_initialized(),
        "shard_functional_trace needs a process group (its size is the world size the trace is built for).",
        "Wrap the call in `with fsdp_pass.fake_process_group(world_size) as group:`.",
    )
    arg_params = parameter_names_of_args(prologue, computation)
    world_size = group.size()
    specs = []
    for a in computation.args:
        if getattr(a, "name", None) in arg_params:
            name = arg_params[a.name]
            layout = ShardLayout(tuple(a.shape), world_size)
            specs.append(ParamSpec(name, name, layout, thunder.dtypes.to_torch_dtype(a.dtype), a.requires_grad))
    sharding = ShardingPlan(world_size, dist.get_rank(group), parse_strategy(strategy), tuple(specs))
    tree = ModuleTree.of(model) if model is not None else None
    plan: UnitPlan = plan_units(computation, arg_params, sharding, units, tree, reshard_after_forward)
    return insert_unshards(computation, plan, arg_params, group), plan


def derive_backward_and_lower(trace, executors=None, schedule: Schedule | None = DEFAULT_SCHEDULE):
    """Thunder's autodiff and lowering, as thunder.jit runs them, then the scheduling pass (unless
    ``schedule`` is None): (forward, backward) executable traces."""
    from fsdp_pass_executors import executors_for
    from thunder.core.compile_data import compile_data_and_stats
    from thunder.core.transforms import dce
    from thunder.executors.passes import del_last_used
    from thunder.transforms.autodiff import grad_transform_on_trace, split_into_forward_and_backward

    executors = executors if executors is not None else executors_for("cpu")
    # Thunder's passes read the executor list from the compile data in scope: give them one
    compile_data = thunder.compile_data(thunder.jit(lambda: None, executors=executors))
    with compile_data_and_stats(compile_data, None):
        joint = grad_transform_on_trace(dce(trace))
        # as thunder.jit lowers: no `del`s before the split, or every intermediate is saved for the backward
        lowered = thunder.transform_for_execution(joint, executors_list=executors, use_del_last_used=False)[-1]
        forward, backward = split_into_forward_and_backward(lowered)
    forward, backward = del_last_used(forward), del_last_used(backward, clear_mutable_collections=True)
    if schedule is not None:
        forward, backward = schedule_collectives(forward, schedule), schedule_collectives(backward, schedule)
    return forward, backward
