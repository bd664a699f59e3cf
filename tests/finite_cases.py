"""Rank functions for tests/test_check_finite.py: ``FSDP(check_finite=True)`` on gloo ranks, NaNs planted on one rank.

Each runs on every rank of a gloo pool and returns plain data the test asserts on.
"""

from __future__ import annotations

import math

import thunder
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fsdp_pass_executors import executors_for

from fsdp_pass import FSDP, FSDPError
from tests import models


def _outcome(fn) -> str:
    """``"ok"``, or the FSDPError's message."""
    try:
        fn()
    except FSDPError as e:
        return str(e)
    return "ok"


def nan_located(poisoned_rank: int = 1) -> dict:
    """The MLP (units fc1, fc2, head) under ZeRO-3 with check_finite=True, one compile with a backward and one
    without (under no_grad). Each case plants a NaN or an inf on ``poisoned_rank`` only; every rank reports what it
    raised. Clean steps between the cases raise nothing (the flags are cleared at each step), and their loss is that
    of the same model jitted without the checks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    plain = thunder.jit(models.build("mlp"), transforms=[FSDP("zero3", units="blocks")], executors=executors_for("cpu"))
    jm = thunder.jit(models.build("mlp"), transforms=[FSDP("zero3", units="blocks", check_finite=True)], executors=executors_for("cpu"))
    x, y = models.batch("mlp", 2 * world, 0)
    x, y = x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2]
    mine = rank == poisoned_rank

    def step(inputs=x, loss_scale=1.0, model=jm):
        loss = F.mse_loss(model(inputs), y) * loss_scale
        loss.backward()
        return float(loss.detach())

    out = {"clean_loss": step(), "plain_loss": step(model=plain)}
    nan_input = x.clone()
    if mine:
        nan_input[0, 3] = math.nan
    out["input"] = _outcome(lambda: step(nan_input))
    out["clean_after_input"] = _outcome(step)
    shard = jm.get_parameter("fc2.weight")  # this rank's rows of fc2's weight
    kept = shard.detach().clone()
    with torch.no_grad():
        if mine:
            shard.view(-1)[5] = math.inf
    out["parameter"] = _outcome(step)
    with torch.no_grad():
        shard.copy_(kept)
    out["gradient"] = _outcome(lambda: step(loss_scale=math.inf if mine else 1.0))  # the forward stays finite
    with torch.no_grad():
        out["no_grad"] = _outcome(lambda: jm(nan_input))  # a compile without a backward decides at its end
    out["clean_at_end"] = _outcome(step)
    return out
