"""Full (unsharded) state dicts for a sharded model: save one, load one, round trip exact.

``full_state_dict(jm, sharded)`` gathers every parameter (one all-gather per sharded tensor) and returns
the same keys as the original module's ``state_dict()``, tied names included. ``load_full_state_dict``
shards a full state dict and copies each rank's shard *into* the existing parameters, so optimizers
holding them keep working. Every rank must call both (they are collective). ``sharded``: the
:class:`~fsdp_pass.shard.module.ShardedModel` of the transform ``jm`` was jitted with
(``fsdp_pass.full_state_dict(jm)`` finds it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_pass.errors import check
from fsdp_pass.plan.layout import ShardLayout, shard_tensor, unpad_gathered
from fsdp_pass.shard.module import ShardedModel


def gather_full(shard: torch.Tensor, layout: ShardLayout, group) -> torch.Tensor:
    """All-gather one dim-0 shard and drop the padding."""
    out = torch.empty((layout.padded_rows, *layout.shape[1:]), dtype=shard.dtype, device=shard.device)
    dist.all_gather_into_tensor(out, shard.detach().contiguous(), group=group)
    return unpad_gathered(out, layout)


def _persistent_buffer_names(module: torch.nn.Module) -> list[str]:
    names = []
    for mod_name, sub in module.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        names.extend(prefix + b for b, _ in sub.named_buffers(recurse=False) if b not in sub._non_persistent_buffers_set)
    return names


def full_state_dict(jm, sharded: ShardedModel, *, cpu: bool = False) -> dict[str, torch.Tensor]:
    plan = sharded.sharding
    gathered: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for spec in plan.params:
        if spec.shard_of not in gathered:
            gathered[spec.shard_of] = gather_full(jm.get_parameter(spec.shard_of), spec.layout, sharded.group)
        out[spec.name] = gathered[spec.shard_of]
    for name in _persistent_buffer_names(jm._model):
        out[name] = jm.get_buffer(name).detach()
    return {k: v.cpu() for k, v in out.items()} if cpu else out


def load_full_state_dict(jm, sharded: ShardedModel, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    plan = sharded.sharding
    expected = [s.name for s in plan.params] + _persistent_buffer_names(jm._model)
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in set(expected)]
    if strict:
        check(
            not missing and not unexpected,
            lambda: f"State dict does not match the model: missing {missing}, unexpected {unexpected}.",
            "Load a full state dict saved from the same architecture (or pass strict=False to load a subset).",
        )
    with torch.no_grad():
        for spec in plan.owners():
            if spec.name not in state_dict:
                continue
            value = state_dict[spec.name]
            check(
                tuple(value.shape) == spec.layout.shape,
                lambda: f"State dict entry {spec.name!r} has shape {tuple(value.shape)}, "
                f"the model expects {spec.layout.shape}.",
                "Load a full (unsharded) state dict of the same model; sharded checkpoints are not loaded here.",
            )
            param = jm.get_parameter(spec.name)
            param.copy_(shard_tensor(value.to(param.device, param.dtype), spec.layout, plan.rank))
        for name in _persistent_buffer_names(jm._model):
            if name in state_dict:
                jm.get_buffer(name).copy_(state_dict[name])
