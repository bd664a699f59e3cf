"""The model's state dict, sharded or full, out and in. Collective: every rank of the FSDP group calls each.

Keys are the original module's ``state_dict()`` keys: every parameter name (tied names too, sharing one
value) and the persistent buffers.

``model_state_dict(jm, sharded, *, full=False, cpu_offload=False, ignore_frozen=False)``
  - sharded (the default): each parameter a DTensor ``Shard(0)`` view of its shard
    (:func:`~fsdp_pass.shard.global_view.as_dtensor`; a 0-d parameter: its value, gathered), buffers as
    they are. ``torch.distributed.checkpoint`` saves it and loads it back at any world size.
  - ``full``: each parameter gathered whole (one all-gather per sharded tensor). With ``cpu_offload``: on
    the CPU, and only rank 0 keeps them (the others get ``{}``), torch's convention against N copies.

``load_model_state_dict(jm, sharded, state_dict, *, form, strict=True, ignore_frozen=False, broadcast=False)``
  1. Every key and value is checked before anything is copied: missing and unexpected keys (with
     ``strict``), and each parameter's value against the ``form`` asked for (``"sharded"``: a DTensor of
     the full shape; ``"full"``: a tensor of the full shape; ``"any"``: either). Every rank raises the same
     :class:`~fsdp_pass.errors.FSDPError`, naming the key, the shape expected and the shape found.
  2. Each value is cut to this rank's padded shard and copied *into* the existing parameter, so an
     optimizer holding it keeps working (nothing to copy when a checkpoint was loaded into the views).
     ``broadcast``: only rank 0 holds the (full) state dict; each tensor is broadcast from it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp_pass.errors import check_on_all_ranks
from fsdp_pass.plan.sharding import ParamSpec
from fsdp_pass.text import bullet_lines
from fsdp_pass.shard.global_view import as_dtensor, gather_full, shard_of
from fsdp_pass.shard.module import ShardedModel

def persistent_buffer_names(module: torch.nn.Module) -> list[str]:
    names = []
    for mod_name, sub in module.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        names.extend(
            prefix + b for b, _ in sub.named_buffers(recurse=False) if b not in sub._non_persistent_buffers_set
        )
    return names


def _specs(sharded: ShardedModel, ignore_frozen: bool) -> list[ParamSpec]:
    return [s for s in sharded.sharding.params if s.requires_grad or not ignore_frozen]


def saved_view(shard: torch.Tensor, spec: ParamSpec, group) -> torch.Tensor:
    """What a sharded state dict holds for a shard: its DTensor view, or a 0-d parameter's value."""
    return gather_full(shard, spec.layout, group) if spec.layout.shape == () else as_dtensor(shard, spec.layout, group)


def model_state_dict(
    jm, sharded: ShardedModel, *, full: bool = False, cpu_offload: bool = False, ignore_frozen: bool = False
) -> dict[str, torch.Tensor]:
    values: dict[str, torch.Tensor] = {}  # by the name of the shard, so tied names share one value
    out: dict[str, torch.Tensor] = {}
    for spec in _specs(sharded, ignore_frozen):
        if spec.shard_of not in values:
            shard = jm.get_parameter(spec.shard_of)
            if full:
                value = gather_full(shard, spec.layout, sharded.group)
            else:
                value = saved_view(shard.cpu() if cpu_offload else shard, spec, sharded.group)
            values[spec.shard_of] = value.cpu() if cpu_offload else value
        out[spec.name] = values[spec.shard_of]
    for name in persistent_buffer_names(jm._model):
        buffer = jm.get_buffer(name).detach()
        out[name] = buffer.cpu() if cpu_offload else buffer
    if full and cpu_offload and dist.get_rank(sharded.groups.everyone) != 0:
        return {}
    return out


def _shape(value) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def value_problem(key: str, value, spec: ParamSpec, form: str) -> str | None:
    """Why ``value`` cannot be loaded into ``spec``'s parameter in ``form`` (None if it can)."""
    layout, found = spec.layout, _shape(value)
    if found is None:
        return f"{key!r}: a {type(value).__name__}, not a tensor"
    wants_plain = layout.shape == ()  # a 0-d parameter is saved whole in either form
    if isinstance(value, DTensor) and not wants_plain:
        if form == "full":
            return (
                f"{key!r}: a DTensor (a sharded state dict), and full_state_dict=True asks for full tensors of "
                f"shape {layout.shape}"
            )
        if found == layout.shape:
            return None
    elif not isinstance(value, DTensor) and found == layout.shape:
        if form != "sharded" or wants_plain:
            return None
        return (
            f"{key!r}: a plain tensor of the full shape {found} (a full state dict), and a sharded state dict "
            "holds DTensors"
        )
    local = "" if wants_plain else f"; this rank's shard is {layout.shard_shape} with padding"
    if found == layout.shard_shape and found != layout.shape:
        local += " (the value looks like one rank's local shard: saved at this world size without DTensors?)"
    return f"{key!r}: shape {found}, the model expects {layout.shape} (full){local}"


def load_problems(
    jm, sharded: ShardedModel, state_dict: dict, *, form: str, strict: bool, ignore_frozen: bool
) -> str | None:
    """Every reason ``state_dict`` cannot be loaded, as one message (None if it can)."""
    specs, sharding = _specs(sharded, ignore_frozen), sharded.sharding
    expected = [s.name for s in specs] + persistent_buffer_names(jm._model)
    problems = []
    loaded = {s.shard_of for s in specs if s.name in state_dict}
    if strict:  # a tied name may be left out when another name of its tensor is there (as HF saves them)
        missing = [
            k for k in expected if k not in state_dict and not (k in sharding and sharding.param(k).shard_of in loaded)
        ]
        frozen = {s.name for s in sharding.params if not s.requires_grad} if ignore_frozen else set()
        unexpected = [k for k in state_dict if k not in set(expected) and k not in frozen]
        if missing:
            problems.append(f"missing keys {missing}")
        if unexpected:
            problems.append(f"unexpected keys {unexpected}")
    for spec in specs:
        if spec.is_tied and spec.name in state_dict and spec.shard_of in state_dict:
            problem = _untied_problem(spec, state_dict[spec.name], state_dict[spec.shard_of])
            if problem:
                problems.append(problem)
        if spec.name in state_dict:
            problem = value_problem(spec.name, state_dict[spec.name], spec, form)
            if problem:
                problems.append(problem)
    if not problems:
        return None
    return f"The state dict does not fit this sharded model ({form} form asked for):{bullet_lines(problems)}"


def _untied_problem(spec: ParamSpec, value, owner_value) -> str | None:
    """Both names of a tied tensor are given: they must hold the same values (the model has one tensor)."""
    if value is owner_value or not isinstance(value, torch.Tensor) or not isinstance(owner_value, torch.Tensor):
        return None
    a = value.to_local() if isinstance(value, DTensor) else value
    b = owner_value.to_local() if isinstance(owner_value, DTensor) else owner_value
    if a.shape == b.shape and torch.equal(a, b.to(a.device, a.dtype)):
        return None
    return (
        f"{spec.name!r} and {spec.shard_of!r} are one tensor in this model (tied), and the state dict gives them "
        "different values (saved from an untied model?)"
    )


LOAD_TODO = (
    "Load a state dict of the same architecture: a sharded one (DTensor values, from fsdp_pass.get_state_dict "
    "or jm.state_dict(), through torch.distributed.checkpoint at any world size) with the default options, or a "
    "full one (plain tensors of the full shapes, e.g. the original module's state_dict()) with "
    "StateDictOptions(full_state_dict=True); pass strict=False to load a subset."
)


def load_model_state_dict(
    jm,
    sharded: ShardedModel,
    state_dict: dict,
    *,
    form: str = "any",
    strict: bool = True,
    ignore_frozen: bool = False,
    broadcast: bool = False,
) -> None:
    group, rank = sharded.group, sharded.sharding.rank  # the shard group, and this rank's place in it
    everyone = sharded.groups.everyone  # HSDP: with broadcast, rank 0 of every rank holds the state dict
    reads = not broadcast or dist.get_rank(everyone) == 0
    problem = (
        load_problems(jm, sharded, state_dict, form=form, strict=strict, ignore_frozen=ignore_frozen) if reads else None
    )
    check_on_all_ranks(problem, LOAD_TODO, everyone)
    present = [None]
    if broadcast:  # the other ranks learn which keys rank 0 holds
        present = [sorted(state_dict)] if reads else [None]
        dist.broadcast_object_list(present, src=dist.get_global_rank(everyone, 0), group=everyone)
    keys = set(present[0]) if broadcast else set(state_dict)
    with torch.no_grad():
        for spec in _specs(sharded, ignore_frozen):
            if spec.is_tied and spec.shard_of in keys:
                continue  # loaded under its first name
            if spec.name not in keys:
                continue
            param = jm.get_parameter(spec.shard_of)
            if broadcast:
                value = _broadcast(state_dict.get(spec.name), spec.layout.shape, param, everyone)
            else:
                value = state_dict[spec.name]
                if isinstance(value, DTensor) and value.to_local().data_ptr() == param.data_ptr():
                    continue  # loaded in place, into the view
            param.copy_(shard_of(value, spec.layout, rank, group, like=param))
        for name in persistent_buffer_names(jm._model):
            if name in keys:
                buffer = jm.get_buffer(name)
                value = (
                    _broadcast(state_dict.get(name), tuple(buffer.shape), buffer, everyone)
                    if broadcast
                    else state_dict[name]
                )
                buffer.copy_(value.full_tensor() if isinstance(value, DTensor) else value)


def _broadcast(value, shape, like: torch.Tensor, group) -> torch.Tensor:
    """Rank 0's ``value`` on every rank (``like``'s dtype and device)."""
    out = (
        value.to(like.device, like.dtype).clone()
        if value is not None
        else torch.empty(shape, dtype=like.dtype, device=like.device)
    )
    dist.broadcast(out, src=dist.get_global_rank(group, 0), group=group)
    return out
