"""The zoo's grouped-query attention (Llama 3's): k and v with fewer heads, each repeated for its query heads.

1. ``llama3-8b`` has Llama-3-8B's published parameter count (its k/v projections are 4096 -> 1024).
2. A tiny attention with 2 kv heads for 4 query heads equals plain multi-head attention whose k and v weights
   hold each kv head's rows twice in place (heads 0, 0, 1, 1: Llama 3's repeat_kv), not tiled (0, 1, 0, 1).
"""

import torch
from torch import nn

from fsdp_pass.models import zoo
from fsdp_pass.models.zoo import Attention


def test_llama3_8b_has_the_published_parameter_count():
    module, (idx, _) = zoo.build("llama3-8b")
    assert zoo.param_count(module) == 8_030_261_248
    assert module.model.layers[0].attn.k.weight.shape == (1024, 4096)
    assert tuple(idx.shape) == (1, 8192)


def test_two_kv_heads_equal_multi_head_with_repeated_kv_weights():
    torch.manual_seed(0)
    d, heads = 32, 4
    gqa = Attention(d, heads, n_kv_head=2)
    mha = Attention(d, heads)
    with torch.no_grad():
        for name in ("q", "o"):
            getattr(mha, name).weight.copy_(getattr(gqa, name).weight)
        for name in ("k", "v"):
            w = getattr(gqa, name).weight  # (2 heads x hd, d)
            getattr(mha, name).weight.copy_(w.view(2, d // heads, d).repeat_interleave(2, dim=0).reshape(d, d))
    x = torch.randn(2, 8, d)
    torch.testing.assert_close(gqa(x), mha(x))
    assert sum(p.numel() for p in gqa.parameters()) < sum(p.numel() for p in mha.parameters())
    assert isinstance(gqa.k, nn.Linear) and gqa.k.out_features == 2 * d // heads
