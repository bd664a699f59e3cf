"""The benchmark's model and data: :mod:`fsdp_pass.models.zoo`'s Llama-style LM, seeded, on CPU in float32.

The model has plain parameters only (no buffers), so every system shards exactly the same set of
tensors, and only plain torch ops, so ``thunder.jit(model)`` traces it as is.
"""

from __future__ import annotations

import torch

from fsdp_pass.models.zoo import Config, LlamaLM, param_count
from fsdp_pass.models.zoo import lm_loss as loss_fn

__all__ = ["Config", "LlamaLM", "build_model", "loss_fn", "make_batch", "param_count"]


def build_model(seed: int = 0, n_layer: int = 4, **overrides) -> LlamaLM:
    """The benchmark model on CPU, float32; the same weights for the same seed on every rank."""
    cfg = Config(n_layer=n_layer, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaLM(cfg)
    return model


def make_batch(step: int, local_batch: int = 4, seq: int = 64, rank: int = 0, vocab: int = 512):
    """(idx, targets), both int64 of shape (local_batch, seq): rank ``rank``'s slice of global batch ``step``.

    A toy language (count upwards mod ``vocab`` from a random start), so the loss falls when training.
    """
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    start = torch.randint(0, vocab, (local_batch, 1), generator=g)
    tokens = (start + torch.arange(seq + 1)) % vocab
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
