"""Where mixed precision casts, against FSDP2 on gloo ranks (module-level functions, so spawned ranks import them).

:class:`FloatResidual` hands its repeated blocks float32 tensors on purpose: a residual stream kept in float32 and
a float32 buffer. FSDP2 with each block and the root wrapped (``fully_shard`` + ``MixedPrecisionPolicy(bfloat16,
float32)``) casts them to bfloat16 at each block's call, so the blocks compute in bfloat16; ours casts at the same
place (:func:`fsdp_pass.shard.forward_inputs.cast_inputs_at_blocks`), whatever its units.
"""

from __future__ import annotations

import copy

import thunder
import torch
import torch.distributed as dist
from fsdp_pass_executors import executors_for
from torch import nn

from fsdp_pass import FSDP, MixedPrecision, fsdp_of
from fsdp_pass.shard.forward_inputs import cast_inputs_at_blocks
from fsdp_pass.shard.global_view import gather_full

BF16 = torch.bfloat16
D, PER_RANK = 16, 4
RECIPE = MixedPrecision(BF16, reduce_dtype=torch.float32)


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.lin = nn.Linear(d, d)

    def forward(self, h, scale):
        return h + self.lin(self.norm(h)) * scale


class FloatResidual(nn.Module):
    """A residual stream kept in float32 between the blocks, and a float32 buffer each block is handed."""

    def __init__(self, d: int = D, blocks: int = 2):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
        self.out = nn.Linear(d, 1)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        h = self.inp(x).float()
        for block in self.blocks:
            h = block(h, scale=self.scale)
        return self.out(h.to(self.out.weight.dtype)).float().square().mean()


def _batch() -> torch.Tensor:
    return torch.randn(dist.get_world_size() * PER_RANK, D, generator=torch.Generator().manual_seed(7))


def _mine(x: torch.Tensor, rank: int) -> torch.Tensor:
    return x[rank * PER_RANK:(rank + 1) * PER_RANK]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def _mean_over_ranks(loss: torch.Tensor) -> float:
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def _fsdp2(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def _one_process(model, x) -> tuple[float, dict]:
    """The recipe in one process: a bfloat16 copy with the same block casts, jitted by plain Thunder, each rank's
    part in turn, gradients averaged in float32."""
    low = copy.deepcopy(model).to(BF16)
    low.scale.data = model.scale.data.clone()  # buffers as the module defines them
    cast_inputs_at_blocks(low, RECIPE)
    jitted = thunder.jit(low, executors=executors_for("cpu"))
    world, sums, total = dist.get_world_size(), {}, 0.0
    for r in range(world):
        loss = jitted(_mine(x, r).to(BF16))
        loss.backward()
        total += float(loss.detach()) / world
        for name, p in low.named_parameters():
            sums[name] = sums.get(name, 0) + p.grad.float() / world
            p.grad = None
    return total, sums


def block_casts_side_by_side(unit_choices) -> dict:
    """Step 0 of FSDP2, the one-process reference and ours (ZeRO-3) under each of ``unit_choices``, on the same
    weights and batch: the mean loss over ranks; each of ours' whole gradients against FSDP2's and the
    reference's, parameter by parameter; how many float32 -> bfloat16 casts our forward trace makes."""
    torch.manual_seed(0)
    model = FloatResidual()
    x, rank = _batch(), dist.get_rank()
    peer = _fsdp2(copy.deepcopy(model))
    peer_loss = peer(_mine(x, rank))
    peer_loss.backward()
    theirs = {name: p.grad.full_tensor() for name, p in peer.named_parameters()}
    reference_loss, reference = _one_process(model, x)
    result = {"fsdp2_loss": _mean_over_ranks(peer_loss), "one_process_loss": reference_loss,
              "fsdp2_vs_one_process": {name: _rel(theirs[name], g) for name, g in reference.items()}}
    for units in unit_choices:
        jm = thunder.jit(copy.deepcopy(model), transforms=[FSDP("zero3", mixed_precision=RECIPE, units=units)],
                         executors=executors_for("cpu"))
        loss = jm(_mine(x, rank))
        loss.backward()
        fsdp = fsdp_of(jm)
        ours = {s.name: gather_full(jm.get_parameter(s.name).grad, s.layout, fsdp.group)
                for s in fsdp.sharding.owners()}
        result[str(units)] = {
            "loss": _mean_over_ranks(loss),
            "vs_fsdp2": {name: _rel(g, theirs[name]) for name, g in ours.items()},
            "vs_one_process": {name: _rel(g, reference[name]) for name, g in ours.items()},
            "units": [u.name for u in fsdp.unit_plan.units],
            "casts_to_bf16": _casts_to_bf16(thunder.last_traces(jm)[0]),
        }
    return result


def _casts_to_bf16(trace) -> int:
    """How many float32 -> bfloat16 casts the forward trace makes of activations (the blocks' inputs)."""
    return sum(1 for b in trace.bound_symbols if b.sym.name == "to" and str(b.output.dtype).endswith("bfloat16")
               and str(b.args[0].dtype).endswith("float32"))
