"""The users' recipe on gloo ranks: Hugging Face Llama-family models with bfloat16 parameters and a float32
reduce, side by side with PyTorch FSDP2 (``fully_shard`` with ``MixedPrecisionPolicy(bfloat16, float32)``) on
the same weights and batches (module-level functions, so spawned ranks can import them).

Each case trains three copies of one model, built from the same seed, for a few AdamW steps:

1. ours: ``thunder.jit(model, transforms=[FSDP(strategy, mixed_precision=MixedPrecision(bf16, float32), ...)])``;
2. FSDP2 with the same mixed precision (each decoder layer a unit, then the root), eager;
3. FSDP2 in float32: how far full precision is from the recipe.

``one_process_reference`` adds a single-process reference that casts as the recipe does (parameters in bfloat16,
buffers as the module has them, gradients averaged in float32 into float32 master weights), jitted by plain
Thunder so that both sides round the same decomposed ops.
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
from fsdp_pass import FSDP, MixedPrecision
from fsdp_pass.models.hf_tracing import trace_hf_models

SEQ, PER_RANK = 32, 2
RECIPE = MixedPrecision(BF16, reduce_dtype=torch.float32)


def tokens(step: int, micro: int = 0) -> torch.Tensor:
    """The global batch of ``step`` (micro-batch ``micro``), the same on every rank: (ranks x PER_RANK, SEQ)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, VOCAB, (dist.get_world_size() * PER_RANK, SEQ), generator=g)


def _mine(ids: torch.Tensor) -> torch.Tensor:
    rank = dist.get_rank()
    return ids[rank * PER_RANK:(rank + 1) * PER_RANK]


def _fsdp2_no_sync(model, sync: bool):
    model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def side_by_side(kind: str, strategy: str, steps: int = 3, micro_batches: int = 1, layers: int = 1,
                 one_process_reference: bool = False, **fsdp_kwargs) -> dict:
    """Per-step mean losses of ours, FSDP2 in the recipe and FSDP2 in float32 (and of the one-process reference);
    ``micro_batches`` > 1 accumulates all but the last under ``fsdp_pass.no_sync`` / FSDP2's
    ``set_requires_gradient_sync(False)``."""
    model = build_hf(kind, layers)
    peer = fully_sharded(copy.deepcopy(model), strategy, True)
    full = fully_sharded(copy.deepcopy(model), strategy, False)
    reference = _OneProcess(copy.deepcopy(model)) if one_process_reference else None
    jm = thunder.jit(model, transforms=[FSDP(strategy, mixed_precision=RECIPE, **fsdp_kwargs)],
                     executors=executors_for("cpu"))
    runs = {
        "ours": (jm, torch.optim.AdamW(jm.parameters(), lr=1e-3), lambda sync: contextlib.nullcontext()
                 if sync else fsdp_pass.no_sync(jm)),
        "fsdp2": (peer, torch.optim.AdamW(peer.parameters(), lr=1e-3), lambda sync: _fsdp2_no_sync(peer, sync)),
        "fsdp2_fp32": (full, torch.optim.AdamW(full.parameters(), lr=1e-3), lambda sync: _fsdp2_no_sync(full, sync)),
    }
    losses = {name: [] for name in [*runs, *(["one_process"] if reference else [])]}
    logits_dtypes = {name: set() for name in runs}
    for step in range(steps):
        batches = [tokens(step, m) for m in range(micro_batches)]
        for name, (module, opt, syncing) in runs.items():
            total = 0.0
            for m, ids in enumerate(batches):
                with syncing(m == micro_batches - 1):
                    out = module(input_ids=_mine(ids), labels=_mine(ids))
                    (out.loss / micro_batches).backward()
                total += out.loss.detach() / micro_batches
                logits_dtypes[name].add(str(out.logits.dtype))
            dist.all_reduce(total)  # the mean over ranks of each rank's loss: the global batch's loss
            losses[name].append(float(total) / dist.get_world_size())
            opt.step()
            opt.zero_grad()
        if reference is not None:
            losses["one_process"].append(reference.step(batches))
    return {
        "losses": losses,
        "logits_dtypes": {name: sorted(d) for name, d in logits_dtypes.items()},
        "shard_dtypes": sorted({str(p.dtype) for p in jm.parameters()}),
    }


class _OneProcess:
    """One process computing what the recipe computes on the global batch: each rank's part through a copy whose
    parameters are bfloat16 (buffers as the module has them), jitted by plain Thunder; gradients averaged over the
    ranks' parts in float32 into the float32 master weights, stepped by AdamW."""

    def __init__(self, model):
        self.master = model
        self.low = copy.deepcopy(model)
        for p in self.low.parameters():
            p.data = p.data.to(BF16)
        self.jitted = trace_hf_models(thunder.jit(self.low, executors=executors_for("cpu")))  # transformers 5
        self.opt = torch.optim.AdamW(self.master.parameters(), lr=1e-3)

    def step(self, batches) -> float:
        with torch.no_grad():
            for p, q in zip(self.master.parameters(), self.low.parameters()):
                q.copy_(p)
        world, sums, total = dist.get_world_size(), {}, 0.0
        for ids in batches:
            for r in range(world):
                part = ids[r * PER_RANK:(r + 1) * PER_RANK]
                loss = self.jitted(input_ids=part, labels=part).loss / len(batches)
                loss.backward()
                total += float(loss.detach()) / world
                for name, q in self.low.named_parameters():
                    if q.grad is not None:
                        g = q.grad.float() / world
                        sums[name] = g if name not in sums else sums[name] + g
                        q.grad = None
        for name, p in self.master.named_parameters():
            p.grad = sums.get(name)
        self.opt.step()
        self.opt.zero_grad()
        return total
