"""A small Llama-style decoder LM for the benchmark, deterministic from a seed.

Token embedding -> N decoder layers (RMSNorm, causal attention with q/k/v/o projections,
RMSNorm, SwiGLU MLP) -> final RMSNorm -> lm_head (not tied). No biases anywhere. No positional
encoding: causal attention alone is enough for a benchmark, and it keeps the model to plain
parameters (no buffers) so every system shards exactly the same set of tensors.

Only plain torch ops are used, so ``thunder.jit(model)`` traces it as is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Config:
    vocab: int = 512
    d: int = 128
    n_head: int = 4
    hidden: int = 352
    n_layer: int = 4
    seq: int = 64
    local_batch: int = 4


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        h = self.n_head
        q = self.q(x).view(B, T, h, C // h).transpose(1, 2)
        k = self.k(x).view(B, T, h, C // h).transpose(1, 2)
        v = self.v(x).view(B, T, h, C // h).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class DecoderLayer(nn.Module):
    def __init__(self, d: int, n_head: int, hidden: int):
        super().__init__()
        self.attn_norm = RMSNorm(d)
        self.attn = Attention(d, n_head)
        self.mlp_norm = RMSNorm(d)
        self.mlp = SwiGLU(d, hidden)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class LlamaLM(nn.Module):
    def __init__(self, cfg: Config = Config()):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d)
        self.layers = nn.ModuleList(DecoderLayer(cfg.d, cfg.n_head, cfg.hidden) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d)
        self.lm_head = nn.Linear(cfg.d, cfg.vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


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


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
