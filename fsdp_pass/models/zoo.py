"""Built-in models: a Llama-style decoder LM in named sizes, for dry runs, the benchmark and the notebooks.

``build(name, device="meta") -> (module, example_args)``: ``name`` names a config in :data:`CONFIGS`
(``llama2-7b`` is Llama-2-7B's shape: 6.74 B parameters; ``llama3-8b`` Llama-3-8B's, with grouped-query
attention, 8.03 B). Built on the meta device nothing is
allocated, so a 7B model fits a laptop; the dry run traces it as it is. (The dry-run CLI also takes
Hugging Face configs and factories of your own: :mod:`fsdp_pass.models.spec`.)

The model: token embedding -> N decoder layers (RMSNorm, causal attention with q/k/v/o projections,
RMSNorm, SwiGLU MLP) -> final RMSNorm -> lm_head (not tied). No biases. The Llama configs rotate q and k by
position as Llama does (rotary embeddings, ``Config.rope_theta``: the cos and sin tables made once per forward
from the positions, in float32, cast to the activations' dtype, and applied in every layer with
``rotate_half``); it adds no parameters and no communication, only ops. The small configs (``tiny``, ``bench``)
leave it out: causal attention alone learns the benchmark's toy language. :class:`WithLoss` puts the cross-entropy inside the module, so the traces (and the memory
predicted from them) cover the whole step.

:class:`ResidualMLP` is the simplest model with repeated blocks (residual two-layer MLPs, a linear head, a
mean-squared-error loss inside), which Thunder traces in a fraction of the LM's time: the mental-model
notebook runs it on real ranks and in dry runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_pass.errors import check


@dataclass(frozen=True)
class Config:
    vocab: int = 512
    d: int = 128
    n_head: int = 4
    hidden: int = 352
    n_layer: int = 4
    seq: int = 64
    local_batch: int = 4
    n_kv_head: int | None = None  # grouped-query attention: heads of k and v (None: n_head, plain attention)
    rope_theta: float | None = None  # rotary position embeddings' base (None: no positional encoding)


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Causal self-attention; with ``n_kv_head`` < ``n_head`` grouped-query attention (Llama 3): k and v have
    ``n_kv_head`` heads, each repeated for ``n_head // n_kv_head`` query heads before the attention."""

    def __init__(self, d: int, n_head: int, n_kv_head: int | None = None):
        super().__init__()
        self.n_head = n_head
        self.n_kv_head = n_kv_head or n_head
        kv = d // n_head * self.n_kv_head
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv, bias=False)
        self.v = nn.Linear(d, kv, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x, rope=None):
        B, T, C = x.shape
        h, g = self.n_head, self.n_kv_head  # (C // h written out per use: the ops traced as before GQA was added)
        q = self.q(x).view(B, T, h, C // h).transpose(1, 2)
        k = self.k(x).view(B, T, g, C // h).transpose(1, 2)
        v = self.v(x).view(B, T, g, C // h).transpose(1, 2)
        if rope is not None:
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        if g != h:
            k, v = _repeat_heads(k, h // g), _repeat_heads(v, h // g)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


def rope_tables(T: int, head_dim: int, theta: float, dtype, device):
    """Llama's rotary tables: (cos, sin), each (T, head_dim): position t times the frequencies
    ``theta ** (-2i / head_dim)``, written twice over the head (the halves ``rotate_half`` pairs)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles = torch.outer(torch.arange(T, dtype=torch.float32, device=device), inv_freq)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x, cos, sin):
    """(B, heads, T, hd) rotated by position: ``x * cos + rotate_half(x) * sin`` (Llama's apply_rotary_pos_emb).
    (No local is named ``t``: the interpreter would name a proxy after it, which the dry run's shortcut refuses.)"""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _repeat_heads(t, times: int):
    """(B, g, T, hd) -> (B, g * times, T, hd), each head repeated ``times`` times in place (as Llama 3's repeat_kv)."""
    if times == 1:
        return t
    B, g, T, hd = t.shape
    return t[:, :, None].expand(B, g, times, T, hd).reshape(B, g * times, T, hd)


class SwiGLU(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class DecoderLayer(nn.Module):
    def __init__(self, d: int, n_head: int, hidden: int, n_kv_head: int | None = None):
        super().__init__()
        self.attn_norm = RMSNorm(d)
        self.attn = Attention(d, n_head, n_kv_head)
        self.mlp_norm = RMSNorm(d)
        self.mlp = SwiGLU(d, hidden)

    def forward(self, x, rope=None):
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


class LlamaLM(nn.Module):
    def __init__(self, cfg: Config = Config()):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d)
        self.layers = nn.ModuleList(DecoderLayer(cfg.d, cfg.n_head, cfg.hidden, cfg.n_kv_head) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d)
        self.lm_head = nn.Linear(cfg.d, cfg.vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        cfg, rope = self.cfg, None
        if cfg.rope_theta is not None:
            rope = rope_tables(idx.shape[1], cfg.d // cfg.n_head, cfg.rope_theta, x.dtype, x.device)
        for layer in self.layers:
            x = layer(x, rope) if rope is not None else layer(x)
        return self.lm_head(self.norm(x))


class WithLoss(nn.Module):
    """``model(idx)`` followed by the next-token cross-entropy: ``forward(idx, targets) -> loss``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx, targets):
        return lm_loss(self.model(idx), targets)


class ResidualMLP(nn.Module):
    """``n_block`` blocks ``x + fc2(tanh(fc1(x)))`` and a linear head; ``forward(x, y)`` -> the mean squared error."""

    def __init__(self, d: int = 256, hidden: int = 1024, n_block: int = 8, n_out: int = 16):
        super().__init__()
        self.blocks = nn.ModuleList(_MLPBlock(d, hidden) for _ in range(n_block))
        self.head = nn.Linear(d, n_out)

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.head(x), y)


class _MLPBlock(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


def regression_batch(model: ResidualMLP, rows: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` random inputs and targets for ``model``, the same for every ``seed``."""
    g = torch.Generator().manual_seed(seed)
    d, n_out = model.head.in_features, model.head.out_features
    return torch.randn(rows, d, generator=g), torch.randn(rows, n_out, generator=g)


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


CONFIGS = {
    "tiny": Config(vocab=64, d=32, n_head=2, hidden=64, n_layer=2, seq=16, local_batch=2),
    "bench": Config(),
    "llama2-7b": Config(vocab=32000, d=4096, n_head=32, hidden=11008, n_layer=32, seq=4096, local_batch=1,
                        rope_theta=10000.0),
    "llama2-13b": Config(vocab=32000, d=5120, n_head=40, hidden=13824, n_layer=40, seq=4096, local_batch=1,
                         rope_theta=10000.0),
    # Llama-3-8B's published config (8.03 B parameters, rotary base 500000; Llama 3.1's frequency scaling for
    # long contexts changes the tables' values, not the ops, and is left out)
    "llama3-8b": Config(vocab=128256, d=4096, n_head=32, hidden=14336, n_layer=32, seq=8192, local_batch=1,
                        n_kv_head=8, rope_theta=500000.0),
}


def build(name: str, device: str | torch.device = "meta", **overrides):
    """(module, example_args) for the config ``name`` on ``device``; ``overrides`` change fields of it."""
    check(
        name in CONFIGS,
        lambda: f"Unknown model {name!r}.",
        f"Name one of {sorted(CONFIGS)} (fsdp_pass.models.spec also builds Hugging Face configs and factories).",
    )
    cfg = replace(CONFIGS[name], **{k: v for k, v in overrides.items() if v is not None})
    with torch.device(device):
        module = WithLoss(LlamaLM(cfg))
        idx = torch.zeros(cfg.local_batch, cfg.seq, dtype=torch.long)
    return module, (idx, idx.clone())


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
