"""A stand-in for transformers 5's mask functions (``transformers/masking_utils.py``,
``transformers/integrations/sdpa_attention.py``), for the tests that run with transformers 4 (the CI's): the same
decisions, written for these tests, on a one-layer attention model.

- :func:`find_packed_sequence_indices`: the ids of the sequences packed in each row (a new sequence starts where a
  position does not follow the one before); None when every row is one sequence, but under a compiler
  (``torch.compiler.is_compiling()``, True while Thunder interprets) the ids, unread.
- :func:`_ignore_causal_mask_sdpa`: whether SDPA's ``is_causal`` can stand for the mask (no padding, square);
  under a compiler False.
- :func:`use_gqa_in_sdpa`: whether to pass ``enable_gqa=True`` (no mask) instead of repeating the key and value
  heads.
- :class:`Attention`: causal self-attention with 4 query heads and 2 key/value heads, which asks the three
  functions as a transformers 5 decoder does, through this module's globals.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def find_packed_sequence_indices(position_ids):
    first = position_ids[:, :1] - 1
    starts = torch.diff(position_ids, prepend=first, dim=-1) != 1
    ids = starts.cumsum(-1)
    if not torch.compiler.is_compiling() and bool((ids[:, -1] == 0).all()):
        return None
    return ids


def _ignore_causal_mask_sdpa(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
    if torch.compiler.is_compiling():
        return False
    return q_length == kv_length and (padding_mask is None or bool(padding_mask.all()))


def use_gqa_in_sdpa(attention_mask, key, value):
    return attention_mask is None


def causal_mask(batch, length, packed=None, padding_mask=None):
    """``(batch, 1, length, length)``: a query sees the keys before it, in its own sequence, not padded."""
    index = torch.arange(length)
    mask = (index[None, :] <= index[:, None]).expand(batch, 1, length, length)
    if packed is not None:
        mask = mask & (packed[:, None, :, None] == packed[:, None, None, :])
    if padding_mask is not None:
        mask = mask & padding_mask.bool()[:, None, None, :]
    return mask


class Attention(nn.Module):
    def __init__(self, d=16, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d // heads
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * kv_heads * self.head_dim)
        self.out = nn.Linear(d, d)

    def forward(self, x, position_ids=None, attention_mask=None, position_step=1):
        b, n, _ = x.shape
        if position_ids is None:
            position_ids = (torch.arange(0, n * position_step, position_step) + 0).unsqueeze(0).expand(b, -1)
        packed = find_packed_sequence_indices(position_ids)
        mask = None
        if packed is not None or not _ignore_causal_mask_sdpa(attention_mask, n, n, 0, 0):
            mask = causal_mask(b, n, packed, attention_mask)
        q = self.q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if use_gqa_in_sdpa(mask, k, v):
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        else:
            repeat = self.heads // self.kv_heads
            k, v = (t.repeat_interleave(repeat, dim=1) for t in (k, v))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.out(y.transpose(1, 2).reshape(b, n, -1))
