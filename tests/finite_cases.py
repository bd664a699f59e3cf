"""Rank functions for tests/test_check_finite.py: ``FSDP(check_finite=True)`` on gloo ranks, NaNs planted on one rank.

Each runs on every rank of a gloo pool and returns plain data the test asserts on: per case, the ``NonFiniteError``'s
message and what it names (``_outcome``).
"""

from __future__ import annotations

import math
from pathlib import Path

import thunder
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fsdp_pass_executors import executors_for

import fsdp_pass
from fsdp_pass import FSDP, FSDPError, MixedPrecision
from fsdp_pass.models.hf_config import hf_causal_lm
from fsdp_pass.ops.finite_checks import checks_of
from tests import models

HF_LLAMA = Path(__file__).parent / "fixtures" / "hf_tiny_llama"


def _outcome(fn) -> dict | str:
    """``"ok"``, or what the FSDPError says: its message and, for a check's error, what it names."""
    try:
        fn()
    except FSDPError as e:
        found = {"message": str(e)}
        if hasattr(e, "check"):
            found.update(parameter=e.parameter, rank=e.rank, phase=e.phase, what=e.check.what, unit=e.check.unit,
                         region=e.check.region)
        return found
    return "ok"


def _mlp_and_batch(device: str, **fsdp_kwargs):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    jm = thunder.jit(models.build("mlp").to(device), transforms=[FSDP("zero3", units="blocks", **fsdp_kwargs)],
                     executors=executors_for(device))
    x, y = models.batch("mlp", 2 * world, 0)
    return jm, x[rank * 2 : rank * 2 + 2].to(device), y[rank * 2 : rank * 2 + 2].to(device)


def nan_located(poisoned_rank: int = 1, device: str = "cpu", **fsdp_kwargs) -> dict:
    """The MLP (units fc1, fc2, head) under ZeRO-3 with check_finite=True, one compile with a backward and one
    without (under no_grad); ``fsdp_kwargs``: more options (``offload_to="cpu"``). Each case plants a NaN or an inf
    on ``poisoned_rank`` only; every rank reports what it raised. Clean steps between the cases raise nothing (the
    flags are cleared at each step), and their loss is that of the same model jitted without the checks."""
    rank = dist.get_rank()
    plain, _, _ = _mlp_and_batch(device, **fsdp_kwargs)
    jm, x, y = _mlp_and_batch(device, check_finite=True, **fsdp_kwargs)
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
    out["forward_only"] = _outcome(lambda: jm(nan_input))  # gradients on, no backward: the forward decides
    shard = jm.get_parameter("fc2.bias")  # this rank's rows of fc2's bias
    kept = shard.detach().clone()
    with torch.no_grad():
        if mine:
            shard.view(-1)[-1] = math.inf
    out["parameter"] = _outcome(step)
    with torch.no_grad():
        shard.copy_(kept)
    out["gradient"] = _outcome(lambda: step(loss_scale=math.inf if mine else 1.0))  # the forward stays finite
    with torch.no_grad():
        out["no_grad"] = _outcome(lambda: jm(nan_input))  # a compile without a backward decides at its end
    out["clean_at_end"] = _outcome(step)
    out["residual"] = _outcome(lambda: _overflow_in_residual_add(jm, x, mine, step))
    return out


def _overflow_in_residual_add(jm, x, mine: bool, step) -> None:
    """fc2's output is ``x + fc2(...)``: fc2's weight zeroed and its bias 3e38 make its linear finite, and on the
    poisoned rank one input 1e38 makes the residual add overflow, after the last op that reads fc2's parameters
    (fc1's output stays finite). The parameters are restored after the step."""
    weight, bias = jm.get_parameter("fc2.weight"), jm.get_parameter("fc2.bias")
    kept = weight.detach().clone(), bias.detach().clone()
    inputs = x.clone()
    if mine:
        inputs[0, 5] = 1e38
    with torch.no_grad():
        weight.zero_()
        bias.fill_(3e38)
    try:
        step(inputs)
    finally:
        with torch.no_grad():
            weight.copy_(kept[0])
            bias.copy_(kept[1])


def hf_llama_located(poisoned_rank: int = 1) -> dict:
    """The tests' 2-layer Hugging Face Llama as ONE unit (``units=[[its top-level modules]]``) under ZeRO-3 with
    check_finite=True, its loss computed inside (labels). Cases, each planted on ``poisoned_rank`` and then
    undone: a NaN in that rank's shard of ``model.layers.1.mlp.down_proj.weight``; layer 1's MLP overflowing (its up
    projection's weight made 1e38, finite, on every rank); an infinite loss (every gradient inf)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model, inputs = hf_causal_lm(HF_LLAMA, "cpu", batch=1, seq=16)
    tokens = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(rank))
    inputs = {"input_ids": tokens, "labels": tokens}
    whole = [[name for name, _ in model.named_children()]]
    jm = thunder.jit(model, transforms=[FSDP("zero3", units=whole, check_finite=True)], executors=executors_for("cpu"))
    mine = rank == poisoned_rank

    def step(scale=1.0):
        (jm(**inputs).loss * scale).backward()

    out = {"clean": _outcome(step)}
    compiled = fsdp_pass.fsdp_of(jm).compiled_step
    out["units"] = [(u.name, u.params) for u in compiled.plan.units]
    out["trainable"] = [n for n, p in jm.named_parameters() if p.requires_grad]
    out["checks"] = [(c.unit, c.what, c.parts, c.region) for c in checks_of(compiled.key)]
    shard = jm.get_parameter("model.layers.1.mlp.down_proj.weight")
    kept = shard.detach().clone()
    with torch.no_grad():
        if mine:
            shard.view(-1)[3] = math.nan
    out["parameter"] = _outcome(step)
    up = jm.get_parameter("model.layers.1.mlp.up_proj.weight")
    kept_up = up.detach().clone()
    with torch.no_grad():
        shard.copy_(kept)
        up.fill_(1e38)
    out["layer_output"] = _outcome(step)
    with torch.no_grad():
        up.copy_(kept_up)
    out["gradient"] = _outcome(lambda: step(math.inf if mine else 1.0))
    out["clean_at_end"] = _outcome(step)
    return out


def sum_overflows_the_reduce(headroom: float = 0.6) -> dict:
    """The MLP under ZeRO-3 with check_finite=True, its gradients reduced in bfloat16
    (``MixedPrecision(reduce_dtype=torch.bfloat16)``, no cast otherwise), every rank on rank 0's batch, the loss
    scaled so that a rank's largest gradient element is ``headroom`` times bfloat16's largest finite value: every
    rank's gradient is finite as its reduce-scatter reads it, and where an element exceeds half that value, the
    two ranks' sum is not. Returns what the step raised and, computed here from a float32 backward of the same
    model and batch (no FSDP), where the first such element lies: the first parameter holding one, the units in the
    order the backward reduces them (the forward's, reversed), each unit's parameters in its order, and the lowest rank whose rows of it (dim 0, ``ceil(rows / ranks)``
    each) hold one."""
    world = dist.get_world_size()
    jm, _, _ = _mlp_and_batch("cpu", check_finite=True, mixed_precision=MixedPrecision(reduce_dtype=torch.bfloat16))
    x, y = (t[:2] for t in models.batch("mlp", 2 * world, 0))  # rank 0's slice, on every rank
    eager = models.build("mlp")
    eager.load_state_dict(fsdp_pass.full_state_dict(jm))
    F.mse_loss(eager(x), y).backward()
    largest = torch.finfo(torch.bfloat16).max
    scale = headroom * largest / max(float(p.grad.abs().max()) for p in eager.parameters())
    grads = {n: (p.grad * scale).to(torch.bfloat16).float() for n, p in eager.named_parameters()}
    found = _outcome(lambda: (F.mse_loss(jm(x), y) * scale).backward())  # the first call compiles
    order = [n for u in reversed(fsdp_pass.fsdp_of(jm).unit_plan.units) for n in u.params]  # the backward's
    first = next(n for n in order if bool((2 * grads[n]).abs().gt(largest).any()))
    rows = grads[first].shape[0]
    overflowing_rows = (2 * grads[first]).abs().gt(largest).reshape(rows, -1).any(dim=1).nonzero().flatten()
    rank = int(overflowing_rows.min()) // -(-rows // world)
    largest_rank_grad = max(float(g.abs().max()) for g in grads.values())
    return {"raised": found, "expected": (first, rank), "largest_rank_grad": largest_rank_grad, "largest": largest}


def scaler_overflow(poisoned_rank: int = 1) -> dict:
    """float16 with ``fsdp_pass.GradScaler(init_scale=2**24)`` and check_finite=True: the first steps' scaled
    gradients overflow float16, which the scaler skips and backs off from (no check raises); then a NaN in
    ``poisoned_rank``'s shard of fc2's bias, which the forward's check still raises for."""
    jm, x, y = _mlp_and_batch("cpu", check_finite=True, mixed_precision=MixedPrecision(torch.float16))
    scaler = fsdp_pass.GradScaler(jm, init_scale=2.0**24)
    opt = torch.optim.SGD(jm.parameters(), lr=0.01)

    def step():
        before = [p.detach().clone() for p in jm.parameters()]
        scaler.scale(F.mse_loss(jm(x).float(), y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return any(not torch.equal(p.detach(), b) for p, b in zip(jm.parameters(), before))

    stepped = []
    out = {"first": _outcome(lambda: stepped.append(step())), "scale_after_first": scaler.get_scale()}
    out["first_stepped"] = stepped
    shard = jm.get_parameter("fc2.bias")
    with torch.no_grad():
        if dist.get_rank() == poisoned_rank:
            shard.view(-1)[0] = math.nan
    out["parameter"] = _outcome(step)
    return out
