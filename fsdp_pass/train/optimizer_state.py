"""Optimizer state keyed by parameter name, each state tensor seen as the whole parameter, and back: the
convention of ``torch.distributed.checkpoint.state_dict`` (``{"state": {name: {key: value}},
"param_groups": [{..., "params": [names]}]}``), for optimizers stepping on the shards.

``optimizer_state_dict(jm, sharded, optimizers, *, full=False, cpu_offload=False)``
  1. An optimizer that has not stepped yet gets its state made (one step with zero gradients and the
     learning rate at 0, as torch does, but also when gradients are there: they are put back), so a fresh
     optimizer has the entries a checkpoint is loaded into.
  2. Each parameter of the optimizer must be one of the model's shards; it is named by its first name
     (a tied parameter has one entry).
  3. A state tensor shaped like the shard (``exp_avg``, ``momentum_buffer``, ...) becomes the shard's
     DTensor view (or, ``full``, is gathered); a scalar (``step``) stays as it is. Any other shape is an
     FSDPError: only element-wise state is sharded the way the parameter is.

``load_optimizer_state_dict(jm, sharded, optimizers, state_dict, *, form, broadcast=False)``
  1. Each optimizer's state is made (step 1 above): it tells which entries are shard-shaped.
  2. Its param groups are matched to the saved ones by parameter name; every name must have its state.
  3. Each shard-shaped value is cut to this rank's padded shard (padding rows zero, as a fresh state's
     are); then ``optimizer.load_state_dict`` puts the states on the parameters' devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch
import torch.distributed as dist
from fsdp_pass.errors import check_on_all_ranks, fail
from fsdp_pass.plan.sharding import ParamSpec
from fsdp_pass.text import bullet_lines
from fsdp_pass.shard.global_view import gather_full, shard_of
from fsdp_pass.shard.module import ShardedModel
from fsdp_pass.shard.state_dict import saved_view, value_problem

STATE, GROUPS, PARAMS = "state", "param_groups", "params"


def as_list(optimizers) -> list[torch.optim.Optimizer]:
    return list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]


def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Make a fresh optimizer's state: one step with zero gradients and every learning rate at 0. Gradients
    already there (a backward before loading a checkpoint) are put back afterwards."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g[PARAMS]]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    lrs = [g.get("lr") for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        if lr is not None:
            g["lr"] = lr
    for p, grad in zip(params, grads):
        p.grad = grad


def _names(jm, sharded: ShardedModel, optimizer) -> dict[int, ParamSpec]:
    """id(parameter) -> the spec of the shard it is, for every parameter of ``optimizer``."""
    by_id = {id(jm.get_parameter(s.name)): s for s in sharded.sharding.owners()}
    found = {}
    for p in chain.from_iterable(g[PARAMS] for g in optimizer.param_groups):
        if id(p) not in by_id:
            fail(
                f"{type(optimizer).__name__} holds a tensor of shape {tuple(p.shape)} that is not one of the sharded "
                "model's parameters.",
                "Build the optimizer from the jitted model's parameters (torch.optim.AdamW(jm.parameters())), "
                "after thunder.jit: the original module's parameters are released.",
            )
        found[id(p)] = by_id[id(p)]
    return found


def param_names(jm, sharded: ShardedModel, optimizer) -> dict[int, str]:
    """id(parameter) -> its (first) name, for every parameter of ``optimizer``."""
    return {i: spec.name for i, spec in _names(jm, sharded, optimizer).items()}


def _is_shard_shaped(value, spec: ParamSpec) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) == spec.layout.shard_shape


def optimizer_state_dict(jm, sharded: ShardedModel, optimizers, *, full=False, cpu_offload=False) -> dict:
    group = sharded.group
    state: dict[str, dict] = {}
    groups: list[dict] = []
    for optimizer in as_list(optimizers):
        init_state(optimizer)
        specs = _names(jm, sharded, optimizer)
        for g in optimizer.param_groups:
            groups.append(
                {**{k: v for k, v in g.items() if k != PARAMS}, PARAMS: [specs[id(p)].name for p in g[PARAMS]]}
            )
            for p in g[PARAMS]:
                spec = specs[id(p)]
                if p not in optimizer.state:
                    continue
                entry = {}
                for key, value in optimizer.state[p].items():
                    if _is_shard_shaped(value, spec):
                        value = value.cpu() if cpu_offload else value
                        value = gather_full(value, spec.layout, group) if full else saved_view(value, spec, group)
                    elif isinstance(value, torch.Tensor) and value.dim() > 0:
                        fail(
                            f"{type(optimizer).__name__}'s state {key!r} of {spec.name!r} has shape "
                            f"{tuple(value.shape)}, neither the shard's {spec.layout.shard_shape} nor a scalar.",
                            "Checkpoint only optimizers whose state is element-wise (Adam, AdamW, SGD, RMSprop, ...); "
                            "a factored state of a shard is not the state of the whole parameter.",
                        )
                    elif cpu_offload and isinstance(value, torch.Tensor):
                        value = value.cpu()
                    entry[key] = value
                state[spec.name] = entry
    if full and cpu_offload and dist.get_rank(sharded.groups.everyone) != 0:
        return {}
    return {STATE: state, GROUPS: groups}


def _saved_group(saved_groups: list[dict], names: list[str]) -> dict | None:
    for g in saved_groups:
        if names and names[0] in g.get(PARAMS, ()):
            return g
    return None


def load_problems(jm, sharded: ShardedModel, optimizers, state_dict: dict, form: str) -> str | None:
    if not isinstance(state_dict, dict) or STATE not in state_dict or GROUPS not in state_dict:
        return "the optimizer state dict has no 'state' and 'param_groups' (not one from fsdp_pass.get_state_dict?)"
    problems = []
    for optimizer in as_list(optimizers):
        specs = _names(jm, sharded, optimizer)
        for g in optimizer.param_groups:
            names = [specs[id(p)].name for p in g[PARAMS]]
            saved = _saved_group(state_dict[GROUPS], names)
            if saved is None or list(saved[PARAMS]) != names:
                problems.append(f"no saved param group holds exactly {names[:3]}{'...' if len(names) > 3 else ''}")
            for p in g[PARAMS]:
                spec = specs[id(p)]
                mine, theirs = optimizer.state.get(p, {}), state_dict[STATE].get(spec.name)
                if theirs is None:
                    if mine:
                        problems.append(f"no state for {spec.name!r}")
                    continue
                extra = sorted(set(theirs) - set(mine))
                if extra:
                    problems.append(
                        f"state {extra} of {spec.name!r}, which this {type(optimizer).__name__} does not keep"
                    )
                for key, value in mine.items():
                    if key not in theirs:
                        problems.append(f"no {key!r} in the state of {spec.name!r}")
                    elif _is_shard_shaped(value, spec):
                        problem = value_problem(f"{spec.name}.{key}", theirs[key], spec, form)
                        if problem:
                            problems.append(problem)
    if not problems:
        return None
    return "The optimizer state dict does not fit these optimizers:" + bullet_lines(problems)


def load_optimizer_state_dict(
    jm, sharded: ShardedModel, optimizers, state_dict, *, form="any", broadcast=False
) -> None:
    group, rank = sharded.group, sharded.sharding.rank
    optimizers = as_list(optimizers)
    for optimizer in optimizers:
        init_state(optimizer)
    # with broadcast, only rank 0 (of every rank of the model) holds the (full) state dict
    reads = not broadcast or dist.get_rank(sharded.groups.everyone) == 0
    problem = load_problems(jm, sharded, optimizers, state_dict, form) if reads else None
    check_on_all_ranks(problem, TODO, sharded.groups.everyone)
    specs = {}  # id(parameter) -> spec, over all optimizers
    templates = {}  # name -> the optimizer's own (fresh) state of that parameter: which entries are shard-shaped
    for optimizer in optimizers:
        specs.update(_names(jm, sharded, optimizer))
        for p, entry in optimizer.state.items():
            templates[specs[id(p)].name] = (specs[id(p)], entry)

    def cut(name: str, key: str, value):
        spec, mine = templates[name]
        return (
            shard_of(value, spec.layout, rank, group, like=mine[key])
            if _is_shard_shaped(mine.get(key), spec)
            else value
        )

    state_dict = _broadcast_and_cut(state_dict, cut, templates.__contains__, sharded) if broadcast else state_dict
    for optimizer in optimizers:
        local, index = {STATE: {}, GROUPS: []}, 0
        for g in optimizer.param_groups:
            names = [specs[id(p)].name for p in g[PARAMS]]
            saved = _saved_group(state_dict[GROUPS], names)
            local[GROUPS].append(
                {**{k: v for k, v in saved.items() if k != PARAMS}, PARAMS: list(range(index, index + len(names)))}
            )
            for name in names:
                theirs = state_dict[STATE].get(name)
                if theirs is not None:
                    local[STATE][index] = {k: v if broadcast else cut(name, k, v) for k, v in theirs.items()}
                index += 1
        optimizer.load_state_dict(local)


@dataclass(frozen=True)
class _TensorSlot:
    """Where a tensor stood in rank 0's state dict, in the structure sent to the other ranks."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _broadcast_and_cut(state_dict, cut, known, sharded: ShardedModel) -> dict:
    """Rank 0's state dict on every rank: its structure as one object, then each tensor broadcast and cut to
    this rank's shard at once (no rank holds more than one full tensor at a time). ``known(name)``: whether
    one of the optimizers holds that parameter (others are skipped, as the unbroadcast path ignores them)."""
    group = sharded.groups.everyone  # HSDP: rank 0 of every rank of the model, not of each shard group
    rank, src = dist.get_rank(group), dist.get_global_rank(group, 0)

    def slot(v):
        return _TensorSlot(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v

    shell = [None]
    if rank == 0:
        shell = [
            {
                STATE: {n: {k: slot(v) for k, v in e.items()} for n, e in state_dict[STATE].items()},
                GROUPS: state_dict[GROUPS],
            }
        ]
    dist.broadcast_object_list(shell, src=src, group=group)
    out = {STATE: {}, GROUPS: shell[0][GROUPS]}
    for name, entry in shell[0][STATE].items():
        if not known(name):  # state of a parameter none of these optimizers holds: not sent (every rank skips it)
            continue
        out[STATE][name] = {}
        for key, v in entry.items():
            if isinstance(v, _TensorSlot):
                mine = state_dict[STATE][name][key] if rank == 0 else None
                t = (
                    mine.to(sharded.device, v.dtype)
                    if rank == 0
                    else torch.empty(v.shape, dtype=v.dtype, device=sharded.device)
                )
                dist.broadcast(t, src=src, group=group)
                v = cut(name, key, t)
            out[STATE][name][key] = v
    return out


TODO = (
    "Load an optimizer state dict saved from the same model and optimizers (fsdp_pass.get_state_dict, any world "
    "size): the same parameter groups, the same optimizer class."
)
