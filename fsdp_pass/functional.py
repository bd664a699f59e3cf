"""The pass, step by step, on a functional trace in one process (what the notebooks do).

    with fake_process_group(8) as group:
        prologue, trace = functional_trace(model, x)                          # Thunder's functional forward
        sharded, plan = shard_functional_trace(prologue, trace, group, "zero3", model=model)  # stages 1-3
        forward, backward = derive_backward_and_lower(sharded, plan)           # autodiff, lowering, stages 5-7

The stages are those of :mod:`fsdp_pass.pipeline`, the ones the ``FSDP`` transform runs: the traces come
out the same as ``thunder.jit(model, transforms=[FSDP(...)])`` makes them. No module is changed and, under a fake
group, nothing is communicated: the traces show what every rank would run. Given a real group of several ranks,
``shard_functional_trace`` is collective: the ranks agree on what they plan from, as the transform's first compile
does (:mod:`fsdp_pass.search.decisions`), and the traces run on them.

Mixed precision acts where Thunder traces the module (its parameters in ``param_dtype``, its floating inputs cast
to it), so a trace for ``mixed_precision=`` is made with it: ``functional_trace(model, x,
mixed_precision=MixedPrecision(torch.bfloat16))``, then ``shard_functional_trace(..., model=model,
mixed_precision=...)`` with the same setting.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import thunder
import torch
import torch.distributed as dist
from fsdp_pass_executors import executors_for
from thunder.core.compile_data import compile_data_and_stats
from torch.distributed.device_mesh import DeviceMesh
from thunder.core.transform_common import Transform
from thunder.core.transforms import dce
from thunder.executors.passes import del_last_used
from thunder.transforms.autodiff import grad_transform_on_trace, split_into_forward_and_backward

from fsdp_pass.errors import check, fail
from fsdp_pass.models.hf_kv_cache import check_no_kv_cache
from fsdp_pass.models.hf_tracing import trace_hf_models
from fsdp_pass.models.thunder_gc_guard import gc_guard
from fsdp_pass.pipeline import finish_lowered, rewrite_forward
from fsdp_pass.search.decisions import settle_planning_inputs
from fsdp_pass.plan.layout import ShardLayout
from fsdp_pass.plan.mixed_precision import MixedPrecision, resolve_mixed_precision, traced_dtype
from fsdp_pass.plan.module_tree import ModuleTree
from fsdp_pass.plan.options import FSDPOptions
from fsdp_pass.plan.schedule import Schedule, resolve_schedule
from fsdp_pass.plan.sharding import ParamSpec, ShardingPlan, parse_strategy
from fsdp_pass.plan.trace_arguments import parameter_names_of_args
from fsdp_pass.plan.units import UnitPlan
from fsdp_pass.shard.forward_inputs import inputs_of_step
from fsdp_pass.shard.mesh import RankGroups, resolve_groups
from fsdp_pass.shard.module import ShardedModel


class _KeepTraces(Transform):
    """Keeps the prologue and computation trace Thunder hands to transforms, changing nothing."""

    def transform_traces_pre_prologue(self, prologue, computation, epilogue, **kwargs):
        self.traces = prologue, computation
        return prologue, computation, epilogue


def functional_trace(model, *args, mixed_precision=None, **kwargs):
    """Thunder's prologue and functional forward trace of ``model(*args, **kwargs)``: what a transform receives.

    ``mixed_precision`` (a :class:`~fsdp_pass.plan.mixed_precision.MixedPrecision` or a dtype): trace it as the
    ``FSDP`` transform does under that setting, on a copy of ``model`` whose floating parameters are in
    ``param_dtype``, with the floating inputs cast to it (unless ``cast_forward_inputs=False``)."""
    check_no_kv_cache(model, kwargs)  # transformers' models: as FSDP's calls (models/hf_kv_cache.py)
    precision = resolve_mixed_precision(mixed_precision)
    if precision.param_dtype is not None:
        model = _with_parameters_traced_as(model, precision)
    args, kwargs = inputs_of_step(args, kwargs, precision)
    keep = _KeepTraces()
    jm = trace_hf_models(thunder.jit(model, transforms=[keep]))  # as FSDP: transformers 5's models
    with gc_guard():  # as FSDP's compiles (models/thunder_gc_guard.py)
        thunder.compile_data(jm).get_computation_and_inputs(*args, **kwargs)
    return keep.traces


def _with_parameters_traced_as(model, precision: MixedPrecision):
    """A copy of ``model`` whose floating parameters are in ``precision.param_dtype`` (tied ones stay tied);
    buffers as they are."""
    copy_ = copy.deepcopy(model)
    with torch.no_grad():
        for p in copy_.parameters():
            p.data = p.data.to(traced_dtype(p, precision))
    return copy_


def sharding_of_trace(prologue, computation, group, strategy, stored_dtypes=None) -> ShardingPlan:
    """The sharding plan of the trace's parameter arguments at the group's world size; ``stored_dtypes``
    (parameter name -> dtype, from the module) are the shards' dtypes where the trace computes in another one
    (mixed precision), else the trace's dtypes are."""
    param_of_arg = parameter_names_of_args(prologue, computation)
    world_size = group.size()
    stored_dtypes = stored_dtypes or {}
    specs = []
    for a in computation.args:
        if getattr(a, "name", None) in param_of_arg:
            name = param_of_arg[a.name]
            layout = ShardLayout(tuple(a.shape), world_size)
            dtype = stored_dtypes.get(name, thunder.dtypes.to_torch_dtype(a.dtype))
            specs.append(ParamSpec(name, name, layout, dtype, a.requires_grad))
    return ShardingPlan(world_size, dist.get_rank(group), parse_strategy(strategy), tuple(specs))


def _check_traced_in(computation, param_of_arg, precision: MixedPrecision) -> None:
    """A trace for mixed precision computes in ``param_dtype``: its floating parameters are in it."""
    want = thunder.dtypes.to_dtype(precision.param_dtype)
    for a in computation.args:
        if getattr(a, "name", None) in param_of_arg and thunder.dtypes.is_float_dtype(a.dtype) and a.dtype != want:
            fail(
                f"mixed_precision computes in {precision.param_dtype}, and this trace's parameter "
                f"{param_of_arg[a.name]!r} is {a.dtype}: the trace was made for full precision.",
                "Trace the model for it: functional_trace(model, *args, mixed_precision=<the same setting>).",
            )


def shard_functional_trace(
    prologue, computation, group, strategy="zero2", units="blocks", model=None, reshard_after_forward=None,
    executors=None, **options
):
    """Stages 1-3 of the pipeline on ``computation``: (the trace with the unit gathers, its UnitPlan).

    ``group``: the process group the parameters are sharded over, or a 2-D ``DeviceMesh`` ``("replicate",
    "shard")`` for HSDP, as ``FSDP(mesh=...)`` takes it (made under ``fake_process_group(replicas * shard_size)``
    with ``init_device_mesh("cpu", (replicas, shard_size), mesh_dim_names=("replicate", "shard"))``).
    ``model`` (the module the trace came from) lets the unit policy see the module tree; without it
    every parameter hangs off the root. ``options``: the other options of ``FSDP(...)`` that shape the traces
    (``mixed_precision``, ``checkpoint_activations``, ``schedule``, ``memory_budget`` and ``cost`` under
    ``"auto"``). The plan keeps the options it was made with (``plan.options``: under ``"auto"`` the auto
    plan's units, resharding and prefetch depths), and :func:`derive_backward_and_lower` schedules with them.
    ``executors``: the list the trace will be lowered with (:func:`derive_backward_and_lower`'s, the CPU's when
    left out): the plan's step summary reads which attentions it runs as one kernel (on the CPU,
    ``cpu_attention``'s flash kernel, which keeps no b·h·s·s scores for the backward).

    Over a real group of several ranks (not the fake one) the call is collective, as ``FSDP``'s first compile is:
    every rank calls it with its own trace, and they agree on the cost inputs (rank 0's) and on the step they plan
    from (:mod:`~fsdp_pass.search.planned_from`), so every rank's traces issue the same collectives whatever the
    shapes each traced.
    """
    check(
        dist.is_initialized(),
        "shard_functional_trace needs a process group (its size is the world size the trace is built for).",
        "Wrap the call in `with fsdp_pass.fake_process_group(world_size) as group:`.",
    )
    fsdp = FSDPOptions.resolve(strategy, units=units, reshard_after_forward=reshard_after_forward, **options)
    tree = ModuleTree.of(model) if model is not None else None
    stored = None
    if fsdp.mixed_precision.param_dtype is not None:
        check(
            model is not None,
            "shard_functional_trace(..., mixed_precision=...) shards float32 master weights (the optimizer's) "
            "of a trace that computes in the lower dtype, and without the module it cannot tell their dtype.",
            "Pass model=<the module the trace was made from>.",
        )
        _check_traced_in(computation, parameter_names_of_args(prologue, computation), fsdp.mixed_precision)
        stored = {n: p.dtype for n, p in model.named_parameters(remove_duplicate=False)}
    groups = resolve_groups(mesh=group) if isinstance(group, DeviceMesh) else RankGroups(group)
    sharding = sharding_of_trace(prologue, computation, groups.shard, fsdp.strategy, stored)
    sharded = ShardedModel(sharding, groups, tree)
    executors = tuple(executors if executors is not None else executors_for("cpu"))
    fsdp = settle_planning_inputs(fsdp, None, groups.everyone)  # the CPU's defaults unless cost= says otherwise
    _, computation, plan, planned = rewrite_forward(prologue, computation, sharded, fsdp, executors=executors)
    # the options the plan was made with (the auto plan's under "auto"): the lowering's stages read them, as the
    # transform's do from its CompiledStep
    return computation, replace(plan, options=planned)


PLANNED = "planned"  # derive_backward_and_lower's schedule: the one the plan was made with


def derive_backward_and_lower(trace, plan: UnitPlan, executors=None, schedule: Schedule | int | None | str = PLANNED):
    """Thunder's autodiff and lowering, as thunder.jit runs them, then stages 5-7 of the pipeline (the
    scheduling pass unless the schedule is None, the lifetime check, the labels): (forward, backward).

    ``schedule``: left out, the one ``shard_functional_trace`` made the plan with (its ``schedule=``, the
    default's, or under ``"auto"`` the auto plan's prefetch depths), as ``FSDP(...)`` schedules its step; else
    a :class:`~fsdp_pass.plan.schedule.Schedule`, a prefetch depth, or None (Thunder's order) instead."""
    executors = executors if executors is not None else executors_for("cpu")
    # Thunder's passes read the executor list from the compile data in scope: give them one
    compile_data = thunder.compile_data(thunder.jit(lambda: None, executors=executors))
    with compile_data_and_stats(compile_data, None):
        joint = grad_transform_on_trace(dce(trace))
        # as thunder.jit lowers: no `del`s before the split, or every intermediate is saved for the backward
        lowered = thunder.transform_for_execution(joint, executors_list=executors, use_del_last_used=False)[-1]
        forward, backward = split_into_forward_and_backward(lowered)
    forward, backward = del_last_used(forward), del_last_used(backward, clear_mutable_collections=True)
    # one process: there are no other ranks to compare collectives with
    fsdp = plan.options if plan.options is not None else FSDPOptions(strategy=plan.sharding.strategy)
    if not (isinstance(schedule, str) and schedule == PLANNED):
        fsdp = replace(fsdp, schedule=resolve_schedule(schedule))
    fsdp = replace(fsdp, verify_ranks=False)
    forward, _ = finish_lowered(forward, "forward", plan, fsdp)
    backward, _ = finish_lowered(backward, "backward", plan, fsdp, forward=forward)
    return forward, backward
