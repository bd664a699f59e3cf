"""What each rank holds around one training step: its batch, its shards before and after ``opt.step()``, its
gradient shards and its optimizer state. The mental-model notebook reads them.

:func:`rank_view` runs on every rank of the default group (``run_on_local_ranks(rank_view, 2, config)``
spawns two gloo ranks): each builds the same :class:`~fsdp_pass.models.zoo.ResidualMLP` from the same seed, jits it
with ``FSDP``, takes its own rows of one global batch, and trains one step of SGD with momentum (one state
per element, so the step is exact to compare; Adam's would be two). :func:`full_parameters`
puts the ranks' shards back together (dim 0, padding rows dropped), and :func:`reference_step` trains one
process, without FSDP, on the whole global batch, to hold the assembled tensors against.
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


def rank_view(config: dict, strategy: str = "zero3", rows_per_rank: int = 4, seed: int = 0) -> RankView:
    """One training step of ``ResidualMLP(**config)`` under ``FSDP(strategy)`` on this rank, on its rows."""
    rank, world = dist.get_rank(), dist.get_world_size()
    fsdp = FSDP(strategy, units="blocks")  # one unit per layer, as the views show them
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
