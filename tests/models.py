"""Tiny models for the test matrix, each with a deterministic batch maker and a loss.

Sizes are chosen to be small (Thunder compiles slowly on CPU) and awkward: odd row counts, 1-D and
0-d parameters, tied embeddings, grouped-query attention, frozen layers.
"""

from __future__ import annotations


import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_pass.models.zoo import RMSNorm


class MLP(nn.Module):
    def __init__(self, d=16, hidden=32, out=4):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.head = nn.Linear(d, out)

    def forward(self, x):
        return self.head(x + self.fc2(F.gelu(self.fc1(x))))


class OddShapes(nn.Module):
    """Row counts not divisible by 2 or 4, a 1-D parameter of odd length and a 0-d parameter."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 5)
        self.b = nn.Linear(5, 3)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 3))
        self.temperature = nn.Parameter(torch.tensor(0.7))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) * self.gain / self.temperature


class FrozenMLP(MLP):
    """The first layer and a 1-D scale are frozen: gathered, never reduce-scattered."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16), requires_grad=False)
        self.fc1.weight.requires_grad_(False)
        self.fc1.bias.requires_grad_(False)

    def forward(self, x):
        return super().forward(x * self.scale)


class CausalSelfAttention(nn.Module):
    def __init__(self, d, n_head, n_kv_head, bias):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, d // n_head
        self.q = nn.Linear(d, d, bias=bias)
        self.kv = nn.Linear(d, 2 * n_kv_head * self.head_dim, bias=bias)
        self.proj = nn.Linear(d, d, bias=bias)

    def forward(self, x, rope=None):
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(B, T, 2 * self.n_kv_head, self.head_dim).transpose(1, 2).split(self.n_kv_head, dim=1)
        if rope is not None:
            q, k = rope(q), rope(k)
        if self.n_kv_head != self.n_head:
            rep = self.n_head // self.n_kv_head
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class GPT2Block(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_head, n_head, bias=True)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class TinyGPT2(nn.Module):
    """GPT-2 style: learned positions, LayerNorm, GELU, lm_head tied to the token embedding."""

    def __init__(self, vocab=37, d=16, n_layer=2, n_head=2, block_size=8):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block_size, d)
        self.blocks = nn.ModuleList(GPT2Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class Rotary(nn.Module):
    def __init__(self, head_dim, block_size, base=10000.0):
        super().__init__()
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
        freqs = torch.outer(torch.arange(block_size).float(), inv)
        self.register_buffer("cos", torch.cat([freqs.cos(), freqs.cos()], -1), persistent=False)
        self.register_buffer("sin", torch.cat([freqs.sin(), freqs.sin()], -1), persistent=False)

    def forward(self, x):
        T = x.shape[-2]
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
        # the tables are float32 buffers: cast to the activations' dtype, as Llama-family models do
        return x * self.cos[:T].to(x.dtype) + rotated * self.sin[:T].to(x.dtype)


class LlamaBlock(nn.Module):
    def __init__(self, d, n_head, n_kv_head, hidden):
        super().__init__()
        self.norm1 = RMSNorm(d)
        self.attn = CausalSelfAttention(d, n_head, n_kv_head, bias=False)
        self.norm2 = RMSNorm(d)
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x, rope):
        x = x + self.attn(self.norm1(x), rope)
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLlama(nn.Module):
    """Llama style: RMSNorm, rotary positions, grouped-query attention (4 query / 2 kv heads), SwiGLU."""

    def __init__(self, vocab=37, d=16, n_layer=2, n_head=4, n_kv_head=2, hidden=24, block_size=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.rope = Rotary(d // n_head, block_size)
        self.layers = nn.ModuleList(LlamaBlock(d, n_head, n_kv_head, hidden) for _ in range(n_layer))
        self.norm = RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x, self.rope)
        return self.lm_head(self.norm(x))


class LeanBlock(nn.Module):
    """A pre-norm decoder block in few modules: causal attention through one fused ``qkv`` projection and one
    ``scaled_dot_product_attention``, then a GELU MLP; each norm an RMS weight of the block (no module)."""

    def __init__(self, d, n_head, hidden):
        super().__init__()
        self.n_head = n_head
        self.norm1 = nn.Parameter(torch.ones(d))
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.norm2 = nn.Parameter(torch.ones(d))
        self.fc = nn.Linear(d, hidden)
        self.out = nn.Linear(hidden, d)

    @staticmethod
    def rms(x, weight):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * weight

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.qkv(self.rms(x, self.norm1)).view(B, T, 3, self.n_head, C // self.n_head)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.rms(x, self.norm2))))


class LeanLM(nn.Module):
    """A language model of :class:`LeanBlock` s (token embedding plus a float32 table of sinusoidal positions, cast to
    the activations' dtype as Llama-family models cast their rotary tables; blocks; a final RMS weight; the head):
    fewer modules and ops than :class:`TinyLlama` (no rotary, no grouped heads, no norm modules), so it compiles in
    about half the time (3.4 CPU s against 6.4-8.1 for one block at width 32, plain ``thunder.jit``, forward and
    backward). Not in :data:`MODELS` (the parity tests run those): the seam matrix (``tests/seam_cases.py``)."""

    def __init__(self, vocab=37, d=32, n_layer=1, n_head=2, hidden=48, block_size=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        angles = torch.outer(torch.arange(block_size).float(), 1e-2 ** (torch.arange(0, d, 2).float() / d))
        self.register_buffer("positions", torch.cat([angles.sin(), angles.cos()], -1), persistent=False)
        self.layers = nn.ModuleList(LeanBlock(d, n_head, hidden) for _ in range(n_layer))
        self.norm = nn.Parameter(torch.ones(d))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        x = x + self.positions[: idx.shape[1]].to(x.dtype)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(LeanBlock.rms(x, self.norm))


MODELS = {
    "mlp": MLP,
    "odd_shapes": OddShapes,
    "gpt2_tied": TinyGPT2,
    "llama_gqa": TinyLlama,
    "frozen": FrozenMLP,
}
LANGUAGE_MODELS = {"gpt2_tied", "llama_gqa", "lean_lm"}

# an explicit unit of modules far apart in the program, per model (names, so ranks can be sent them)
NON_ADJACENT_UNITS = {
    "mlp": [["fc1", "head"]],
    "odd_shapes": [["a", "temperature"]],
    "gpt2_tied": [["wpe", "ln_f"], "blocks.*.attn"],  # plus a glob: each block's attention its own unit
    "llama_gqa": [["embed", "lm_head"]],  # the "root unit" FSDP1 would build, asked for on purpose
    "frozen": [["fc1", "head"]],  # a frozen and a trainable module in one unit
}


def build(name: str, seed: int = 0, config: dict | None = None) -> nn.Module:
    """``MODELS[name]`` with ``config`` as its constructor's keyword arguments (e.g. ``{"n_layer": 1}``)."""
    torch.manual_seed(seed)
    return MODELS[name](**(config or {}))


def batch(name: str, global_batch: int, step: int, seq: int = 8):
    """A deterministic (inputs, targets) global batch for ``name`` at ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    if name in LANGUAGE_MODELS:
        tokens = torch.randint(0, 37, (global_batch, seq + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    d_in = 7 if name == "odd_shapes" else 16
    d_out = 3 if name == "odd_shapes" else 4
    return torch.randn(global_batch, d_in, generator=g), torch.randn(global_batch, d_out, generator=g)


def loss_fn(name: str, out, target):
    if name in LANGUAGE_MODELS:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    return F.mse_loss(out, target)
