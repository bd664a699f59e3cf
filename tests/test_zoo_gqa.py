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


def test_rotary_embeddings_rotate_each_pair_of_q_and_k_by_its_position():
    """Llama's rotary embedding (``Config.rope_theta``): the pair (i, i + hd/2) of a head at position t is rotated
    by t * theta ** (-2i / hd) (as complex numbers); and with it the model tells the order of the tokens apart
    (without it, the last position's attention sees the same set of tokens in either order: the same logits)."""
    torch.manual_seed(0)
    T, hd, theta = 6, 8, 10000.0
    cos, sin = zoo.rope_tables(T, hd, theta, torch.float32, "cpu")
    x = torch.randn(1, 2, T, hd)
    angles = torch.arange(T)[:, None] * theta ** (-torch.arange(0, hd, 2) / hd)
    pairs = torch.complex(x[..., : hd // 2], x[..., hd // 2 :]) * torch.polar(torch.ones_like(angles), angles)
    torch.testing.assert_close(zoo._rotate(x, cos, sin), torch.cat((pairs.real, pairs.imag), dim=-1))

    for rope, distinct in ((None, False), (theta, True)):
        model = zoo.LlamaLM(zoo.Config(vocab=16, d=16, n_head=2, hidden=32, n_layer=1, seq=T, rope_theta=rope))
        with torch.no_grad():
            logits = model(torch.tensor([[1, 2, 3, 4, 5, 6], [2, 1, 3, 4, 5, 6]]))
        assert (not torch.allclose(logits[0, -1], logits[1, -1])) == distinct, rope
