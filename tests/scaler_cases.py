"""Loss scaling across shards (``fsdp_pass.GradScaler``) on every rank of a gloo RankPool, against one process
running torch's ``GradScaler`` on the whole model (module-level functions, so spawned ranks can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import fsdp_pass
from fsdp_pass import full_state_dict
from tests import models
from tests.rank_cases import _local, _reference_and_fsdp_model, _rel

SCALE = 2.0**10  # a power of two: scaling and unscaling are exact, so both sides see the same gradients


def _overflow(grad: torch.Tensor) -> None:
    """What a float16 overflow leaves in a gradient: one element inf (the first of the tensor)."""
    grad.view(-1)[0] = float("inf")


def _changed(params, before) -> bool:
    return any(not torch.equal(p.detach(), b) for p, b in zip(params, before))


def overflow_on_one_rank(model_name: str, strategy: str, steps: int = 4, overflow_at: int = 1):
    """SGD under ``fsdp_pass.GradScaler``; at step ``overflow_at`` an inf is planted in the gradient shard of rank 0
    only (the first row of the first trainable parameter, which rank 0 holds); the reference plants it in the same
    element of the whole gradient. Then one more step under torch's own ``GradScaler``, the same overflow planted:
    what each rank does there shows why the verdict must be shared."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    reference, jm, fsdp = _reference_and_fsdp_model(model_name, strategy)
    first = next(s for s in fsdp.sharding.owners() if s.requires_grad)
    opt = torch.optim.SGD(jm.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1)
    scaler = fsdp_pass.GradScaler(jm, init_scale=SCALE)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)

    def step(scaler_, x, y, plant: bool) -> bool:
        """One scaled step of ours; whether this rank's shards changed."""
        before = [p.detach().clone() for p in jm.parameters()]
        loss = models.loss_fn(model_name, jm(_local(x, rank, world_size)), _local(y, rank, world_size))
        scaler_.scale(loss).backward()
        if plant and rank == 0:
            _overflow(jm.get_parameter(first.name).grad)
        scaler_.step(opt)
        scaler_.update()
        opt.zero_grad()
        return _changed(jm.parameters(), before)

    stepped, ref_stepped, scales, ref_scales = [], [], [], []
    for i in range(steps):
        x, y = models.batch(model_name, 2 * world_size, i)
        stepped.append(step(scaler, x, y, plant=i == overflow_at))
        scales.append(scaler.get_scale())

        before = [p.detach().clone() for p in reference.parameters()]
        ref_scaler.scale(models.loss_fn(model_name, reference(x), y)).backward()
        if i == overflow_at:
            _overflow(reference.get_parameter(first.name).grad)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
        ref_stepped.append(_changed(reference.parameters(), before))
        ref_scales.append(ref_scaler.get_scale())

    full = full_state_dict(jm)
    param_err = max(_rel(full[n], p.detach()) for n, p in reference.named_parameters())

    x, y = models.batch(model_name, 2 * world_size, steps)
    local_verdict_stepped = step(torch.amp.GradScaler("cpu", init_scale=SCALE), x, y, plant=True)
    return {
        "stepped": stepped,
        "ref_stepped": ref_stepped,
        "scales": scales,
        "ref_scales": ref_scales,
        "param_rel_err": param_err,
        "torch_scaler_stepped": local_verdict_stepped,
    }
