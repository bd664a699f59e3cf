"""``torch.autocast`` around a sharded model's step, on every rank of a gloo RankPool, against one process running
the same model under the same autocast (module-level functions, so spawned ranks can import them)."""

from __future__ import annotations

import thunder
import torch
import torch.distributed as dist
from fsdp_pass_executors import executors_for

from fsdp_pass import full_state_dict
from tests import models
from tests.rank_cases import _local, _reference_and_fsdp_model, _rel


def autocast_parity(model_name: str, strategy: str, dtype=torch.bfloat16, steps: int = 3):
    """Float32 parameters, the forward run under ``torch.autocast("cpu", dtype)``, AdamW on the shards; the reference
    runs each rank's part of the global batch through the whole model jitted by plain Thunder under the same
    autocast (the same decomposed ops round the same way) and averages the gradients."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    reference, jm, _ = _reference_and_fsdp_model(model_name, strategy)
    jitted_reference = thunder.jit(reference, executors=executors_for("cpu"))
    opt = torch.optim.AdamW(jm.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    loss_err, out_dtypes = [], set()
    for step in range(steps):
        x, y = models.batch(model_name, 2 * world_size, step)
        with torch.autocast("cpu", dtype):
            out = jm(_local(x, rank, world_size))
        out_dtypes.add(str(out.dtype))
        loss = models.loss_fn(model_name, out.float(), _local(y, rank, world_size))
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= world_size

        ref_loss = 0.0
        for r in range(world_size):
            with torch.autocast("cpu", dtype):
                ref_out = jitted_reference(_local(x, r, world_size))
            part = models.loss_fn(model_name, ref_out.float(), _local(y, r, world_size)) / world_size
            part.backward()
            ref_loss += float(part.detach())
        loss_err.append(abs(float(mean) - ref_loss) / abs(ref_loss))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    full = full_state_dict(jm)
    return {
        "loss_rel_err": max(loss_err),
        "param_rel_err": max(_rel(full[n], p.detach()) for n, p in reference.named_parameters()),
        "out_dtypes": sorted(out_dtypes),
        "shard_dtypes": sorted({str(p.dtype) for p in jm.parameters()}),
    }

