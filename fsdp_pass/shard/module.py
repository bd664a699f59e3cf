"""Shard a ThunderModule's parameters in place of the originals (the transform's module step).

``shard_module(thunder_module, groups, strategy, device, broadcast_from, release, offload_to) -> ShardedModel``

1. Check the input: a process group, parameters on one device.
2. Name every parameter, with tied names pointing at the first name of their tensor.
3. Materialize meta-device submodules one at a time (``to_empty`` + ``reset_parameters``).
4. Optionally broadcast full parameters and buffers from one rank so all ranks start equal.
5. Replace each parameter by this rank's dim-0 shard (a new ``nn.Parameter``, registered as a
   Thunder override under every name that shares it). Buffers stay replicated.
6. Optionally release the original full tensors (replaced by meta tensors of the same shape). Thunder traces
   the module's code on these: under mixed precision a floating parameter's meta tensor has ``param_dtype``, so
   the trace computes in it as the module's own code says (its casts kept), while the shard stays float32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from thunder.core.module import ThunderModule

from fsdp_pass.errors import check, fail
from fsdp_pass.plan.layout import ShardLayout, shard_tensor
from fsdp_pass.plan.mixed_precision import FULL_PRECISION, MixedPrecision, traced_dtype
from fsdp_pass.plan.module_tree import ModuleTree
from fsdp_pass.plan.sharding import ParamSpec, ShardingPlan, Strategy
from fsdp_pass.shard.mesh import RankGroups, resolve_groups


def resolve_device(module: torch.nn.Module, device) -> torch.device:
    """The device shards live on: the argument, else the model's device, else cuda:LOCAL_RANK (cpu without CUDA)."""
    tensors = list(module.parameters()) + list(module.buffers())
    devices = {t.device for t in tensors}
    check(
        len(devices) <= 1,
        lambda: f"The model's parameters and buffers are on several devices: {sorted(map(str, devices))}.",
        "Move the whole model to one device first (model.to(device)), or build all of it on the meta device.",
    )
    if device is not None:
        return torch.device(device)
    if devices and next(iter(devices)).type != "meta":
        return devices.pop()
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _materialize(module: torch.nn.Module, device: torch.device) -> None:
    """Give meta-device submodules real storage on ``device`` and initialize them with reset_parameters()."""
    for name, sub in module.named_modules():
        local = list(sub.parameters(recurse=False)) + list(sub.buffers(recurse=False))
        if not any(t.is_meta for t in local):
            continue
        check(
            hasattr(sub, "reset_parameters"),
            lambda: (
                f"Submodule {name or '<root>'!r} ({type(sub).__name__}) is on the meta device "
                "and has no reset_parameters() to initialize it."
            ),
            "Add a reset_parameters() method that initializes its parameters and buffers, "
            "or build the model on a real device.",
        )
        sub.to_empty(device=device, recurse=False)
        with torch.no_grad():
            sub.reset_parameters()


@dataclass(frozen=True)
class ShardedModel:
    """Where a model's shards are: what the stages after sharding need to know of the module.

    The functional (tutorial) path makes one from a trace alone: no devices, a flat tree."""

    sharding: ShardingPlan
    groups: RankGroups  # the process groups: the shard group, and with HSDP the replicate group
    tree: ModuleTree | None = None  # the module tree the unit policy reads (None: every parameter under the root)
    device: torch.device | None = None  # where the step computes
    shard_device: torch.device | None = None  # where the shards live between uses: offload_to, else device
    placed_on: torch.device | None = None  # where the shard tensors are: shard_device, or meta in a dry run

    @property
    def group(self):
        """The torch.distributed ProcessGroup the parameters are sharded over."""
        return self.groups.shard


def sharding_plan(thunder_module, group, strategy: Strategy) -> ShardingPlan:
    """One spec per parameter name; a tied name points at the first name of its tensor."""
    world_size = dist.get_world_size(group)
    first_name: dict[int, str] = {}
    specs = []
    for name, p in thunder_module.named_parameters(remove_duplicate=False):
        owner = first_name.setdefault(id(p), name)
        specs.append(ParamSpec(name, owner, ShardLayout(tuple(p.shape), world_size), p.dtype, p.requires_grad))
    return ShardingPlan(world_size=world_size, rank=dist.get_rank(group), strategy=strategy, params=tuple(specs))


def _check_broadcast_source(broadcast_from, world_size: int) -> None:
    check(
        broadcast_from is None or 0 <= broadcast_from < world_size,
        f"broadcast_from={broadcast_from} is not a rank of the model's ranks (world size {world_size}).",
        f"Pass a rank in 0..{world_size - 1}, or None to keep each rank's own initial weights.",
    )


def _replicate_buffers(thunder_module, group, device, broadcast_from) -> None:
    """Buffers stay whole on every rank: moved to ``device`` (and taken from rank ``broadcast_from`` of ``group``,
    every rank of the model)."""
    shared = thunder_module._get_shared_names()
    for name, b in list(thunder_module.named_buffers()):
        moved = b.to(device, copy=broadcast_from is not None)
        if broadcast_from is not None:
            dist.broadcast(moved, src=dist.get_global_rank(group, broadcast_from), group=group)
        if moved is not b or broadcast_from is not None:
            for n2 in shared[name]:
                thunder_module._overrides_buffers[n2] = moved


def _shard_parameters(thunder_module, sharding: ShardingPlan, group, device, shard_device, broadcast_from, release,
                      precision: MixedPrecision):
    """Each parameter replaced, under every name sharing it, by this rank's shard (the whole parameter taken from
    rank ``broadcast_from`` of ``group``, every rank of the model, first); released, the original's tensor becomes
    a meta tensor in the dtype the step computes in."""
    shared = thunder_module._get_shared_names()
    for spec in sharding.owners():
        full = thunder_module.get_parameter(spec.name).detach().to(device, copy=broadcast_from is not None)
        if broadcast_from is not None:
            dist.broadcast(full, src=dist.get_global_rank(group, broadcast_from), group=group)
        local = place_shard(shard_tensor(full, spec.layout, sharding.rank), shard_device, device)
        shard = torch.nn.Parameter(local, requires_grad=spec.requires_grad)
        for n2 in shared[spec.name]:
            thunder_module._overrides_parameters[n2] = shard
        if release:  # traced on the compute device: the module's code computes there
            _release(thunder_module._model, shared[spec.name], device, precision)


def shard_module(
    thunder_module, groups: RankGroups, strategy: Strategy, device, broadcast_from, release_originals: bool,
    offload_to=None, precision: MixedPrecision = FULL_PRECISION,
) -> ShardedModel:
    """Shard ``thunder_module``'s parameters over ``groups.shard`` (steps 3-6 of the module docstring)."""
    check(
        release_originals or precision.param_dtype is None,
        f"mixed_precision with param_dtype={precision.param_dtype} traces the model with its parameters in that "
        "dtype, on meta tensors that take the place of the released originals; with "
        "release_original_parameters=False the original module keeps its own float tensors, and the step would "
        "trace in their dtype.",
        "Keep release_original_parameters=True (the default); for a full copy of the weights use "
        "fsdp_pass.full_state_dict(jm).",
    )
    original = thunder_module._model
    device = resolve_device(original, device)
    shard_device = device if offload_to is None else torch.device(offload_to)
    if device.type != "meta" and any(t.is_meta for t in list(original.parameters()) + list(original.buffers())):
        _materialize(original, device)  # on the meta device itself (a dry run) nothing is allocated
        # to_empty made new tensors: point the ThunderModule at them
        thunder_module._overrides_parameters.update(original.named_parameters(remove_duplicate=False))
        thunder_module._overrides_buffers.update(original.named_buffers(remove_duplicate=False))
    tree = ModuleTree.of(original)
    sharding = sharding_plan(thunder_module, groups.shard, strategy)
    everyone = groups.everyone
    _check_broadcast_source(broadcast_from, dist.get_world_size(everyone))
    with torch.no_grad():
        _replicate_buffers(thunder_module, everyone, device, broadcast_from)
        # a dry run (meta device) allocates nothing, offloaded or not; its traces still show the copies
        placed_on = device if device.type == "meta" else shard_device
        _shard_parameters(
            thunder_module, sharding, everyone, device, placed_on, broadcast_from, release_originals, precision
        )
    return ShardedModel(sharding, groups, tree, device, shard_device, placed_on)


def place_shard(shard: torch.Tensor, shard_device: torch.device, device: torch.device) -> torch.Tensor:
    """A shard where it lives between uses: ``shard_device``, in pinned memory when that is the CPU and the
    compute ``device`` a GPU (so its copies to the GPU run asynchronously)."""
    shard = shard.to(shard_device)
    return shard.pin_memory() if shard_device.type == "cpu" and device.type == "cuda" else shard


def _release(original: torch.nn.Module, names, device: torch.device, precision: MixedPrecision) -> None:
    """Swap the original module's full tensor for a meta tensor of the same shape (frees its memory), in the dtype
    the step computes in (:func:`~fsdp_pass.plan.mixed_precision.traced_dtype`).

    Thunder reads ``_thunder_device`` to trace a meta tensor as if it lived on ``device``.
    """
    meta = None
    for n in sorted(names):
        mod_name, _, attr = n.rpartition(".")
        sub = original.get_submodule(mod_name)
        p = getattr(sub, attr)
        if meta is None:
            meta = torch.nn.Parameter(
                p.detach().to("meta", traced_dtype(p, precision)), requires_grad=p.requires_grad
            )
            meta._thunder_device = device
        sub.register_parameter(attr, meta)


def check_process_group(process_group=None, mesh=None) -> RankGroups:
    """The groups of ``FSDP(process_group=..., mesh=...)``, once a process group is initialized."""
    check(
        dist.is_available() and dist.is_initialized(),
        "FSDP needs an initialized torch.distributed process group, and none is initialized.",
        "Call torch.distributed.init_process_group() before thunder.jit (under torchrun: "
        "init_process_group(backend='gloo') on CPU, 'nccl' on CUDA). To build traces in one process at any "
        "world size use fsdp_pass.fake_process_group(world_size).",
    )
    return resolve_groups(process_group, mesh)


def check_not_sharded_yet(thunder_module) -> None:
    _check_not_jitted(thunder_module._model)
    if getattr(thunder_module._model, "use_fsdp", False):
        fail(
            "This model is already sharded by thunder.distributed.fsdp.",
            "Apply only one FSDP: use thunder.jit(model, transforms=[fsdp_pass.FSDP(...)]) on the plain model.",
        )
    if getattr(thunder_module, "_fsdp_pass_plan", None) is not None:
        fail(
            "fsdp_pass.FSDP was applied twice to the same model.",
            "Pass a single FSDP(...) in transforms=[...]; to change the strategy, jit the original model again "
            "(it starts from this module's current weights).",
        )


def _check_not_jitted(module) -> None:
    """The module given to thunder.jit must not be one thunder.jit returned (one would wrap the other)."""
    if not isinstance(module, ThunderModule):
        return
    sharded = getattr(module, "_fsdp_pass_plan", None) is not None
    fail(
        "thunder.jit was given a module that thunder.jit returned"
        + (" (sharded by fsdp_pass.FSDP: its shards hold the weights)." if sharded else "."),
        "Jit the original module instead, thunder.jit(jm._model, transforms=[fsdp_pass.FSDP(...)])"
        + (
            ": it starts from the jitted module's current weights (e.g. to change the strategy); make a new "
            "optimizer over the new module's parameters."
            if sharded
            else "."
        ),
    )
