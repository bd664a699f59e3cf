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
from fsdp_pass import FSDP, MixedPrecision

BF16 = torch.bfloat16
VOCAB, SEQ, PER_RANK = 256, 32, 2
RECIPE = MixedPrecision(BF16, reduce_dtype=torch.float32)


def build(kind: str, layers: int = 1) -> torch.nn.Module:
    """A tiny Hugging Face causal LM of the family ``kind``, float32, seeded."""
    import transformers as hf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, max_position_embeddings=128, use_cache=False)
    configs = {
        "llama": (hf.LlamaConfig, hf.LlamaForCausalLM, dict(common, num_key_value_heads=2)),  # GQA, rotary, RMSNorm
        "qwen2": (hf.Qwen2Config, hf.Qwen2ForCausalLM, dict(common, num_key_value_heads=2)),  # + q/k/v biases
        # learned positions, LayerNorm, tied head; no dropout (Thunder draws other masks than eager torch)
        "gpt2": (hf.GPT2Config, hf.GPT2LMHeadModel,
                 dict(vocab_size=VOCAB, n_embd=64, n_layer=layers, n_head=4, n_positions=128, use_cache=False,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        "neox": (hf.GPTNeoXConfig, hf.GPTNeoXForCausalLM, common),  # partial rotary, parallel residual
    }
    config_class, model_class, kwargs = configs[kind]
    torch.manual_seed(0)
    return model_class(config_class(**kwargs))


def decoder_layers(model) -> list[torch.nn.Module]:
    base = getattr(model, "model", None) or getattr(model, "transformer", None) or model.gpt_neox
    return list(getattr(base, "layers", None) or base.h)


def tokens(step: int, micro: int = 0) -> torch.Tensor:
    """The global batch of ``step`` (micro-batch ``micro``), the same on every rank: (ranks x PER_RANK, SEQ)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, VOCAB, (dist.get_world_size() * PER_RANK, SEQ), generator=g)


def _mine(ids: torch.Tensor) -> torch.Tensor:
    rank = dist.get_rank()
    return ids[rank * PER_RANK:(rank + 1) * PER_RANK]


def _fsdp2(model, strategy: str, precision: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32) if precision else MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=strategy == "zero3")
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _fsdp2_no_sync(model, sync: bool):
    model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def side_by_side(kind: str, strategy: str, steps: int = 3, micro_batches: int = 1, layers: int = 1,
                 one_process_reference: bool = False, **fsdp_kwargs) -> dict:
    """Per-step mean losses of ours, FSDP2 in the recipe and FSDP2 in float32 (and of the one-process reference);
    ``micro_batches`` > 1 accumulates all but the last under ``fsdp_pass.no_sync`` / FSDP2's
    ``set_requires_gradient_sync(False)``."""
    model = build(kind, layers)
    peer, full = _fsdp2(copy.deepcopy(model), strategy, True), _fsdp2(copy.deepcopy(model), strategy, False)
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
        self.jitted = thunder.jit(self.low, executors=executors_for("cpu"))
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
