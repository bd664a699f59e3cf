"""Rank functions for tests/test_misuse.py: what a user may do to a sharded model after jitting it.

Each runs on every rank of a gloo pool and returns plain data the test asserts on.
"""

from __future__ import annotations

import copy
import gc

import thunder
import torch
import torch.distributed as dist
from fsdp_pass_executors import executors_for

from fsdp_pass import FSDP, FSDPError, fsdp_of, full_state_dict, load_full_state_dict
from fsdp_pass.shard.global_view import gather_full
from tests import models


def _jit(model, strategy: str):
    return thunder.jit(model, transforms=[FSDP(strategy)], executors=executors_for("cpu"))


def _error_of(fn) -> str:
    try:
        fn()
    except FSDPError as e:
        return str(e)
    return "no error"


def _build(name: str, built_on: str) -> torch.nn.Module:
    if built_on == "meta":
        with torch.device("meta"):
            return models.MODELS[name]()
    return models.build(name)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def rejit_keeps_weights(name: str, built_on: str) -> dict:
    """Jit, change the weights in the shards (as training does), then misuse the original and re-jit it."""
    model = _build(name, built_on)
    jm = _jit(model, "zero3")
    trained = models.build(name, seed=7).state_dict()  # weights neither the model's own nor a fresh init
    load_full_state_dict(jm, trained)
    buffers = {k: b.clone() for k, b in jm.named_buffers()}
    out = {
        "call_original": _error_of(lambda: model(models.batch(name, 2, 0)[0])),
        "jit_jitted": _error_of(lambda: _jit(jm, "zero2")),
    }
    jm2 = _jit(model, "zero2")  # jitted again: from the shards, on every rank
    out["weights_kept"] = _same(full_state_dict(jm2), trained)
    out["buffers_kept"] = _same({k: b for k, b in jm2.named_buffers()}, buffers)
    out["released_again"] = all(p.is_meta for p in model.parameters())
    out["tied_kept"] = [(s.name, s.shard_of) for s in fsdp_of(jm2).sharding.params if s.is_tied]
    del jm, jm2
    gc.collect()  # the jitted modules held the only copy of the weights
    out["holder_gone"] = _error_of(lambda: _jit(model, "zero2"))
    return out


def rejit_on_one_rank_only() -> str:
    """Only rank 0 jits the sharded module again: it raises within the first FSDP's timeout, not a hang."""
    model = models.build("mlp")
    thunder.jit(model, transforms=[FSDP("zero3", timeout=2)], executors=executors_for("cpu"))
    if dist.get_rank() != 0:
        FSDP()  # made on every rank, as rank 0 makes one below: the ranks keep counting their models alike
        return "stayed"
    return _error_of(lambda: _jit(model, "zero2"))


def _grads_like_reference(jm, reference, group) -> dict[str, float | None]:
    """Per owner parameter: max |gathered shard grad - reference grad| (None where the shard has no grad)."""
    errors = {}
    for spec in fsdp_of(jm).sharding.owners():
        grad = jm.get_parameter(spec.name).grad
        full = None if grad is None else gather_full(grad, spec.layout, group)
        errors[spec.name] = None if full is None else float((full - reference.get_parameter(spec.name).grad).abs().max())
    return errors


def _step(jm, reference, step: int, optimizers) -> dict[str, float | None]:
    """One SGD step of both on the same global batch (each rank its half); the gradient errors before it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = models.batch("mlp", 2 * world, step)
    models.loss_fn("mlp", jm(x[2 * rank : 2 * rank + 2]), y[2 * rank : 2 * rank + 2]).backward()
    models.loss_fn("mlp", reference(x), y).backward()
    errors = _grads_like_reference(jm, reference, dist.group.WORLD)
    for opt in optimizers:
        opt.step()
        opt.zero_grad()
    return errors


def freeze_after_compile_then_rejit() -> dict:
    """Train a step, freeze fc1.weight on the jitted module, train a step (Thunder compiles a variant), then
    jit the original module again with another strategy."""
    reference = models.build("mlp")
    model = copy.deepcopy(reference)
    jm = _jit(model, "zero3")
    optimizers = [torch.optim.SGD(jm.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)]
    out = {"step0": _step(jm, reference, 0, optimizers)}
    jm.get_parameter("fc1.weight").requires_grad_(False)
    reference.fc1.weight.requires_grad_(False)
    out["step1"] = _step(jm, reference, 1, optimizers)
    out["plan_frozen"] = not fsdp_of(jm).sharding.param("fc1.weight").requires_grad
    before = full_state_dict(jm)
    jm2 = _jit(model, "zero2")
    out["weights_kept"] = _same(full_state_dict(jm2), before)
    out["frozen_kept"] = not jm2.get_parameter("fc1.weight").requires_grad
    x = models.batch("mlp", 2, 5)[0]
    with torch.no_grad():
        out["output_error"] = float((jm2(x) - reference(x)).abs().max())
    return out
