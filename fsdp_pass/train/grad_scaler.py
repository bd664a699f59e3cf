"""``GradScaler``: float16 loss scaling for a sharded model, skipping a step on every rank or on none.

With ``MixedPrecision(torch.float16)`` the backward computes gradients in float16, whose range ends at 65504, so
the loss is scaled up before the backward and the gradients scaled down before the step, and a step whose
gradients overflowed is skipped (torch's ``GradScaler``). Sharded, each rank holds 1/N of every gradient: an
inf or NaN lands in the shard of the one rank whose rows it is in, torch's ``GradScaler`` on the other ranks
finds their shards finite and steps, and the ranks' weights part for good.

1. ``unscale_`` (called by ``step`` when the user did not): torch's, on this rank's gradient shards, giving
   this rank's verdict per device (inf/NaN found or not);
2. one all-reduce (max) of that verdict over every rank of the model (HSDP's replicas too), on
   :func:`~fsdp_pass.ranks.reduce_device`: every rank now holds the same verdict, "found" when any
   rank's shard held an inf or a NaN;
3. ``step`` and ``update`` are torch's, reading that verdict: every rank skips or steps, and every rank's
   scale backs off or grows, together.

4. With ``FSDP(check_finite=True)``, an enabled scaler takes over the gradients' overflow: the backward's checks
   raise nothing (an inf or NaN gradient is what this scaler skips the step for), the forward's still raise
   (:mod:`fsdp_pass.ops.finite_checks`).

Use it as torch's: ``scaler = fsdp_pass.GradScaler(jm)``, ``scaler.scale(loss).backward()``, optionally
``scaler.unscale_(opt)`` then ``fsdp_pass.clip_grad_norm_(jm, max_norm)``, ``scaler.step(opt)``,
``scaler.update()``. bfloat16 has float32's range and needs no scaler.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_pass.api import fsdp_of
from fsdp_pass.ops.finite_checks import scaler_handles_gradients
from fsdp_pass.ranks import reduced_across_ranks


class GradScaler(torch.amp.GradScaler):
    """torch's ``GradScaler`` whose inf/NaN verdict is agreed by every rank of ``jitted``'s model.

    ``device``: the device type the loss is computed on (default: where the model computes); the other keyword
    arguments are torch's (``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
    ``enabled``)."""

    def __init__(self, jitted, device: str | None = None, **kwargs):
        fsdp = fsdp_of(jitted)
        self._group = fsdp.groups.everyone
        super().__init__(device or fsdp.model.device.type, **kwargs)
        scaler_handles_gradients(fsdp.scope, self.is_enabled())  # step 4

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)  # step 1
        mine = max((float(t.item()) for t in per_device.values()), default=0.0)
        anywhere = reduced_across_ranks([mine], dist.ReduceOp.MAX, self._group)[0]  # step 2
        if not per_device:  # this rank holds no gradient: it still records the verdict, so update() can read it
            per_device = {found_inf.device: found_inf}
        for verdict in per_device.values():
            verdict.fill_(anywhere)
        return per_device
