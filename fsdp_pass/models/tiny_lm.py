"""The main job's small Llama-style model and its toy language (count upwards mod V).

``TinyLM(vocab, d, n_layer, n_head, hidden, block_size)``: token and position embeddings -> ``n_layer``
pre-norm blocks (RMSNorm, causal attention with one fused q/k/v projection, RMSNorm, SwiGLU MLP) -> RMSNorm
-> head. ``counting_batch(batch, seq, vocab, step)``: inputs and next-token targets of ``batch`` sequences
that count upwards from a random start (seeded by ``step``, so every rank draws the same global batch).
Used by the main job (:mod:`fsdp_pass.demo`), the training loop (:mod:`fsdp_pass.loop`) and the timeline
(:mod:`fsdp_pass.report.timeline`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, n_head, hidden):
        super().__init__()
        self.n_head = n_head
        self.norm1 = nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.norm2 = nn.RMSNorm(d)
        self.up = nn.Linear(d, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class TinyLM(nn.Module):
    def __init__(self, vocab=64, d=64, n_layer=2, n_head=4, hidden=128, block_size=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block_size, d)
        self.layers = nn.ModuleList(Block(d, n_head, hidden) for _ in range(n_layer))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def counting_batch(batch, seq, vocab, step):
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    tokens = (start + torch.arange(seq + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]
