"""The users' recipe on gloo ranks: Hugging Face Llama-family models with bfloat16 parameters and a float32
reduce, side by side with PyTorch FSDP2 (``fully_shard`` with ``MixedPrecisionPolicy(bf16, float32)``) on
the same weights and batches (module-level functions, so spawned ranks can import them).

Each case trains four copies of one model, built from the same seed, for a few steps of one optimizer:

1. ours: ``thunder.jit(model, transforms=[FSDP(strategy, mixed_precision=MixedPrecision(bf16, float32), ...)])``;
2. FSDP2 with the same mixed precision (each decoder layer a unit, then the root), eager;
3. FSDP2 in float32: how far full precision is from the recipe;
4. one process that casts as the recipe does (:class:`_OneProcess`): parameters in bfloat16, buffers as the module
   has them, jitted by plain Thunder so that both sides round the same decomposed ops, each rank's gradient summed
   over its micro-batches in float32, then over the ranks, divided by the ranks, into float32 master weights.

Per step: each copy's mean loss over the global batch, and each parameter's full gradient (ours gathered from the
shards, FSDP2's ``full_tensor()``) compared by name with FSDP2's and with the one-process reference's, before the
optimizer steps. The optimizer is SGD unless a case asks for AdamW: SGD's update is the gradient times the learning
rate, so a gradient of the wrong scale moves every later step's loss, where AdamW's first update divides it out.

``plants`` trains ours' first step again with a bug planted on our side only, by the loss each rank backpropagates
(:data:`PLANTS`), before the real first step (the same compile, no optimizer step): the gradients it leaves are
compared like the real ones, so the test can show that the comparison catches that bug.
"""

from __future__ import annotations

import contextlib
import copy

import thunder
import torch
import torch.distributed as dist
from fsdp_pass_executors import executors_for

import fsdp_pass
from bench.recipe_parity import BF16, VOCAB, build_hf, fully_sharded
from fsdp_pass import FSDP, MixedPrecision, fsdp_of
from fsdp_pass.models.hf_tracing import trace_hf_models
from fsdp_pass.shard.global_view import gather_full
from tests.rank_cases import _rel

SEQ, PER_RANK = 32, 2
RECIPE = MixedPrecision(BF16, reduce_dtype=torch.float32)
SGD_LR = 1.0  # plain SGD: the update is the gradient times this, so a gradient of the wrong scale shows in the
# parameters every later step starts from (the reference's gradients, compared every step, see them)
ADAMW_LR = 1e-3


def _weights_summed(micro: int, micro_batches: int, world: int) -> float:
    """Each rank's gradients summed over the ranks instead of averaged: as if each loss were ``world`` times it."""
    return world / micro_batches


def _weights_undivided(micro: int, micro_batches: int, world: int) -> float:
    """The micro-batches accumulated under ``no_sync`` not divided by their number: only the last one is."""
    return 1.0 if micro < micro_batches - 1 else 1.0 / micro_batches


def _weights_clean(micro: int, micro_batches: int, world: int) -> float:
    return 1.0 / micro_batches


# planted bug -> the factor on ours' loss of micro-batch ``micro`` of ``micro_batches`` over ``world`` ranks
PLANTS = {"summed": _weights_summed, "undivided": _weights_undivided}


def tokens(step: int, micro: int = 0) -> torch.Tensor:
    """The global batch of ``step`` (micro-batch ``micro``), the same on every rank: (ranks x PER_RANK, SEQ)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, VOCAB, (dist.get_world_size() * PER_RANK, SEQ), generator=g)


def _mine(ids: torch.Tensor) -> torch.Tensor:
    rank = dist.get_rank()
    return ids[rank * PER_RANK:(rank + 1) * PER_RANK]


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=SGD_LR) if name == "sgd" else torch.optim.AdamW(params, lr=ADAMW_LR)


def _fsdp2_syncing(model):
    def syncing(sync: bool):
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    return syncing


def _our_syncing(jm):
    return lambda sync: contextlib.nullcontext() if sync else fsdp_pass.no_sync(jm)


def _our_grads(jm) -> dict[str, torch.Tensor | None]:
    """Each trainable parameter's full gradient, gathered from the shards (collective)."""
    fsdp = fsdp_of(jm)
    grads = {}
    for s in fsdp.sharding.owners():
        shard = jm.get_parameter(s.name).grad if s.requires_grad else None
        grads[s.name] = None if shard is None else gather_full(shard, s.layout, fsdp.group).float()
    return grads


def _fsdp2_grads(model) -> dict[str, torch.Tensor | None]:
    """Each parameter's full gradient (collective)."""
    return {n: None if p.grad is None else p.grad.full_tensor().float() for n, p in model.named_parameters()}


def _errors(ours: dict, theirs: dict) -> dict[str, float]:
    """Per parameter name, ``max |ours - theirs| / max |theirs|``; infinite where either side has no gradient."""
    return {name: float("inf") if ours.get(name) is None or theirs.get(name) is None else _rel(ours[name], theirs[name])
            for name in sorted(set(ours) | set(theirs))}


def _backward(module, batches, syncing, weight) -> tuple[torch.Tensor, set[str]]:
    """This rank's part of each micro-batch through ``module``, its loss times ``weight(micro, micro_batches,
    world)`` backpropagated, all but the last under ``syncing(False)``. (The mean of this rank's losses, the
    logits' dtypes.)"""
    total, dtypes, n = 0.0, set(), len(batches)
    for m, ids in enumerate(batches):
        with syncing(m == n - 1):
            out = module(input_ids=_mine(ids), labels=_mine(ids))
            (out.loss * weight(m, n, dist.get_world_size())).backward()
        total += out.loss.detach() / n
        dtypes.add(str(out.logits.dtype))
    return total, dtypes


def _planted(jm, opt, batches, plants) -> dict[str, dict[str, torch.Tensor | None]]:
    """Ours' gradients of the first step with each planted bug (:data:`PLANTS`); the gradients emptied after."""
    grads = {}
    for name in plants:
        _backward(jm, batches, _our_syncing(jm), PLANTS[name])
        grads[name] = _our_grads(jm)
        opt.zero_grad()
    return grads


def side_by_side(kind: str, strategy: str, steps: int = 3, micro_batches: int = 1, layers: int = 1,
                 optimizer: str = "sgd", plants: tuple[str, ...] = (), **fsdp_kwargs) -> dict:
    """Per-step mean losses of ours, FSDP2 in the recipe, FSDP2 in float32 and the one-process reference; per step
    and parameter, the relative error of ours' gradient to FSDP2's and to the reference's (and, with ``plants``, of
    the first step's planted gradients). ``micro_batches`` > 1 accumulates all but the last under
    ``fsdp_pass.no_sync`` / FSDP2's ``set_requires_gradient_sync(False)``."""
    model = build_hf(kind, layers)
    peer = fully_sharded(copy.deepcopy(model), strategy, True)
    full = fully_sharded(copy.deepcopy(model), strategy, False)
    reference = _OneProcess(copy.deepcopy(model), optimizer)
    jm = thunder.jit(model, transforms=[FSDP(strategy, mixed_precision=RECIPE, **fsdp_kwargs)],
                     executors=executors_for("cpu"))
    runs = {
        "ours": (jm, _optimizer(optimizer, jm.parameters()), _our_syncing(jm), _our_grads),
        "fsdp2": (peer, _optimizer(optimizer, peer.parameters()), _fsdp2_syncing(peer), _fsdp2_grads),
        "fsdp2_fp32": (full, _optimizer(optimizer, full.parameters()), _fsdp2_syncing(full), None),
    }
    losses = {name: [] for name in [*runs, "one_process"]}
    logits_dtypes = {name: set() for name in runs}
    grad_errors = {"fsdp2": [], "one_process": []}  # [step] -> {parameter: error of ours}
    planted = _planted(jm, runs["ours"][1], [tokens(0, m) for m in range(micro_batches)], plants)
    for step in range(steps):
        batches = [tokens(step, m) for m in range(micro_batches)]
        grads = {}
        for name, (module, opt, syncing, full_grads) in runs.items():
            total, dtypes = _backward(module, batches, syncing, _weights_clean)
            logits_dtypes[name] |= dtypes
            dist.all_reduce(total)  # the mean over ranks of each rank's loss: the global batch's loss
            losses[name].append(float(total) / dist.get_world_size())
            if full_grads is not None:
                grads[name] = full_grads(module)
            opt.step()
            opt.zero_grad()
        loss, grads["one_process"] = reference.step(batches)
        losses["one_process"].append(loss)
        for other in grad_errors:
            grad_errors[other].append(_errors(grads["ours"], grads[other]))
        if step == 0:
            planted = {bug: {other: _errors(g, grads[other]) for other in grad_errors} for bug, g in planted.items()}
    return {
        "losses": losses,
        "grad_errors": grad_errors,
        "planted": planted,
        "logits_dtypes": {name: sorted(d) for name, d in logits_dtypes.items()},
        "shard_dtypes": sorted({str(p.dtype) for p in jm.parameters()}),
        "tied": sorted({s.shard_of for s in fsdp_of(jm).sharding.params if s.is_tied}),  # names used twice
    }


class _OneProcess:
    """One process computing what the recipe computes on the global batch: each rank's part through a copy whose
    parameters are bfloat16 (buffers as the module has them), jitted by plain Thunder; each gradient cast to
    float32, summed over the rank's micro-batches, then over the ranks, divided by the ranks (the order FSDP sums
    in: accumulated locally, then reduce-scattered), into the float32 master weights."""

    def __init__(self, model, optimizer: str):
        self.master = model
        self.low = copy.deepcopy(model)
        for p in self.low.parameters():
            p.data = p.data.to(BF16)
        self.jitted = trace_hf_models(thunder.jit(self.low, executors=executors_for("cpu")))  # transformers 5
        self.opt = _optimizer(optimizer, self.master.parameters())

    def _rank_grads(self, batches, r: int) -> tuple[float, dict[str, torch.Tensor]]:
        """Rank ``r``'s part of every micro-batch: its mean loss, its gradients summed in float32."""
        sums, total = {}, 0.0
        for ids in batches:
            part = ids[r * PER_RANK:(r + 1) * PER_RANK]
            loss = self.jitted(input_ids=part, labels=part).loss / len(batches)
            loss.backward()
            total += float(loss.detach())
            for name, q in self.low.named_parameters():
                if q.grad is not None:
                    sums[name] = q.grad.float() if name not in sums else sums[name] + q.grad.float()
                    q.grad = None
        return total, sums

    def step(self, batches) -> tuple[float, dict[str, torch.Tensor]]:
        """The mean loss over the global batch and each parameter's gradient; then the optimizer's step."""
        with torch.no_grad():
            for p, q in zip(self.master.parameters(), self.low.parameters()):
                q.copy_(p)
        world = dist.get_world_size()
        parts = [self._rank_grads(batches, r) for r in range(world)]
        grads = {}
        for name, p in self.master.named_parameters():
            summed = None
            for _, sums in parts:
                if name in sums:
                    summed = sums[name] if summed is None else summed + sums[name]
            p.grad = grads[name] = None if summed is None else summed / world
        self.opt.step()
        self.opt.zero_grad()
        return sum(loss for loss, _ in parts) / world, grads
