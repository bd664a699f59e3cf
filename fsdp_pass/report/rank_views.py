"""What each rank holds around one training step: its batch, its shards before and after ``opt.step()``, its
gradient shards and its optimizer state. The mental-model notebook reads them.

:func:`rank_view` runs on every rank of the default group (``run_on_local_ranks(rank_view, 2, config)``
spawns two gloo ranks): each builds the same :class:`~fsdp_pass.models.zoo.ResidualMLP` from the same seed, jits it
with ``FSDP``, takes its own rows of one global batch, and trains one step of SGD with momentum (one state
per element, so the step is exact to compare; Adam's would be two). :func:`full_parameters`
puts the ranks' shards back together (dim 0, padding rows dropped), and :func:`reference_step` trains one
process, without FSDP, on the whole global batch, to hold the assembled tensors against.

:func:`adamw_steps` (on every rank) and :func:`reference_adamw_steps` (one process) train several steps with
AdamW and keep, after each, every parameter's shard and its two AdamW states: the ZeRO notebook holds each
rank's rows and state, step after step, against the same rows of the whole model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import thunder
import torch
import torch.distributed as dist
from fsdp_pass_executors import executors_for

from fsdp_pass.models.zoo import ResidualMLP, regression_batch
from fsdp_pass.plan.units import UnitPlan
from fsdp_pass.transform import FSDP

LR, MOMENTUM = 0.1, 0.9


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


@dataclass(frozen=True)
class RankView:
    rank: int
    inputs: torch.Tensor  # this rank's rows of the global batch
    loss: float  # the loss on those rows
    before: dict[str, torch.Tensor]  # parameter -> this rank's shard before the step
    grads: dict[str, torch.Tensor]  # parameter -> this rank's gradient shard, after the backward
    backward_changed_shards: bool  # whether any shard differs after the backward from before the forward
    after: dict[str, torch.Tensor]  # parameter -> this rank's shard after opt.step()
    optimizer_bytes: int  # the optimizer state this rank holds
    plan: UnitPlan  # the units of its compile, with every parameter's shard layout


def _model(config: dict, seed: int) -> ResidualMLP:
    torch.manual_seed(seed)
    return ResidualMLP(**config)


def global_batch(config: dict, world_size: int, rows_per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of one global batch: ``rows_per_rank`` rows for each of ``world_size`` ranks."""
    return regression_batch(ResidualMLP(**config), rows_per_rank * world_size)


def rank_view(config: dict, strategy: str = "zero3", rows_per_rank: int = 4, seed: int = 0, units="blocks") -> RankView:
    """One training step of ``ResidualMLP(**config)`` under ``FSDP(strategy, units=units)`` on this rank, on its
    rows."""
    rank, world = dist.get_rank(), dist.get_world_size()
    fsdp = FSDP(strategy, units=units)
    jm = thunder.jit(_model(config, seed), transforms=[fsdp], executors=executors_for("cpu"))
    inputs, targets = global_batch(config, world, rows_per_rank)
    rows = slice(rank * rows_per_rank, (rank + 1) * rows_per_rank)
    opt = _optimizer(jm.parameters())
    before = {n: p.detach().clone() for n, p in jm.named_parameters()}
    loss = jm(inputs[rows], targets[rows])
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in jm.named_parameters()}
    changed = any(not torch.equal(before[n], p) for n, p in jm.named_parameters())
    opt.step()
    after = {n: p.detach().clone() for n, p in jm.named_parameters()}
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim() > 0)
    return RankView(rank, inputs[rows], loss.item(), before, grads, changed, after, state, fsdp.unit_plan)


def full_parameters(shards: list[dict[str, torch.Tensor]], plan: UnitPlan) -> dict[str, torch.Tensor]:
    """Every rank's shard of each parameter (rank 0's first), put back together on dim 0, padding dropped."""
    full = {}
    for name in shards[0]:
        layout = plan.sharding.param(name).layout
        whole = torch.cat([s[name].reshape(layout.shard_shape) for s in shards])
        full[name] = whole[: layout.rows].reshape(layout.shape)
    return full


def reference_step(config: dict, world_size: int, rows_per_rank: int = 4, seed: int = 0):
    """One process, no FSDP: the same model trained one step on the whole global batch of ``world_size``
    ranks. Returns (loss, parameters before, gradients, parameters after), by name."""
    module = _model(config, seed)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    opt = _optimizer(module.parameters())
    loss = module(*global_batch(config, world_size, rows_per_rank))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters()}
    opt.step()
    return loss.item(), before, grads, {n: p.detach().clone() for n, p in module.named_parameters()}


@dataclass(frozen=True)
class RankSteps:
    rank: int
    plan: UnitPlan  # the units of its compile, with every parameter's shard layout
    # one dict per step, parameter -> after that step's opt.step(): this rank's shard, AdamW's exp_avg and
    # exp_avg_sq of it, and the addresses of the shard's and of exp_avg's storage (the same tensors, step after step)
    shards: list[dict[str, torch.Tensor]]
    exp_avg: list[dict[str, torch.Tensor]]
    exp_avg_sq: list[dict[str, torch.Tensor]]
    addresses: list[dict[str, tuple[int, int]]]


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def _state_after_steps(module, opt, batches, step) -> tuple:
    """Train ``module`` one step per batch; after each, (params, exp_avg, exp_avg_sq, addresses) by name."""
    kept = ([], [], [], [])
    for inputs, targets in batches:
        step(inputs, targets).backward()
        opt.step()
        opt.zero_grad()
        named = list(module.named_parameters())
        kept[0].append({n: p.detach().clone() for n, p in named})
        kept[1].append({n: opt.state[p]["exp_avg"].clone() for n, p in named})
        kept[2].append({n: opt.state[p]["exp_avg_sq"].clone() for n, p in named})
        kept[3].append({n: (p.data_ptr(), opt.state[p]["exp_avg"].data_ptr()) for n, p in named})
    return kept


def _global_batches(config: dict, world_size: int, rows_per_rank: int, steps: int):
    model = ResidualMLP(**config)
    return [regression_batch(model, rows_per_rank * world_size, seed=1 + s) for s in range(steps)]


def adamw_steps(config: dict, steps: int = 2, rows_per_rank: int = 4, seed: int = 0, strategy: str = "zero2",
                units="blocks") -> RankSteps:
    """``steps`` AdamW steps of ``ResidualMLP(**config)`` under ``FSDP(strategy, units=units)`` on this rank, each
    on its rows of a new global batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    fsdp = FSDP(strategy, units=units)
    jm = thunder.jit(_model(config, seed), transforms=[fsdp], executors=executors_for("cpu"))
    rows = slice(rank * rows_per_rank, (rank + 1) * rows_per_rank)
    batches = [(x[rows], y[rows]) for x, y in _global_batches(config, world, rows_per_rank, steps)]
    kept = _state_after_steps(jm, _adamw(jm.parameters()), batches, jm)
    return RankSteps(rank, fsdp.unit_plan, *kept)


def reference_adamw_steps(config: dict, world_size: int, steps: int = 2, rows_per_rank: int = 4, seed: int = 0):
    """One process, no FSDP: :func:`adamw_steps`' steps on the whole global batches. Returns (parameters,
    exp_avg, exp_avg_sq), each a list of one dict per step."""
    module = _model(config, seed)
    kept = _state_after_steps(module, _adamw(module.parameters()), _global_batches(config, world_size, rows_per_rank, steps),
                              module)
    return kept[:3]
