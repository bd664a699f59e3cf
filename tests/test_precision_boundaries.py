"""Mixed precision's stated difference from FSDP2's defaults (plan/mixed_precision.py)."""

import torch

from fsdp_pass import MixedPrecision

BF16 = torch.bfloat16


def test_the_default_reduce_dtype_is_float32_and_none_is_fsdp2s():
    """The stated difference from FSDP2's default (``reduce_dtype=None``, the compute dtype): ours reduces in
    float32 unless told otherwise; None reduces as computed, what FSDP2's default does."""
    assert MixedPrecision(BF16).reduce_dtype is torch.float32
    assert MixedPrecision(BF16).describe().endswith("reduce float32, outputs as computed")
    assert "reduce as computed" in MixedPrecision(BF16, reduce_dtype=None).describe()
