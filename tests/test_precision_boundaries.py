"""Mixed precision casts the floating inputs of every repeated block, as FSDP2 does at each module it wraps
(``tests/precision_cases.py``: a model that hands its blocks float32 tensors), whatever the units."""

import torch

from fsdp_pass import MixedPrecision
from fsdp_pass.shard.forward_inputs import cast_inputs_at_blocks
from tests import precision_cases
from tests.precision_cases import BF16, FloatResidual
from tests.tolerances import ulps_of_reduce


def test_blocks_compute_in_bf16_as_under_fsdp2(ranks):
    """Every parameter's gradient at step 0 within two bfloat16 ulps of FSDP2's (Thunder rounds its decomposed
    LayerNorm otherwise than eager torch: 0.58 % measured, FSDP2 against the one-process reference the same), and
    identical to the one-process reference that makes the same casts; the default units (one unit on this tiny
    model) and units="blocks" alike. Without the block casts the trace fails: a bfloat16 linear of float32."""
    r = ranks(2).run(precision_cases.block_casts_side_by_side, [None, "blocks"])[0]
    assert r["fsdp2_loss"] == r["one_process_loss"], r
    assert r["None"]["units"] == ["inp..out"] and r["blocks"]["units"] == ["inp", "blocks.0", "blocks.1", "out"], r
    for units in ("None", "blocks"):
        ours = r[units]
        assert ours["loss"] == r["fsdp2_loss"], (units, r)
        assert max(ours["vs_fsdp2"].values()) <= ulps_of_reduce(BF16), (units, ours)
        assert max(ours["vs_one_process"].values()) == 0.0, (units, ours)
        # block 0: its float32 residual and table; block 1: the table (block 0 returns bfloat16)
        assert ours["casts_to_bf16"] == 3, (units, ours)


def test_the_casts_sit_at_the_repeated_blocks_only():
    """The blocks get one hook each (not the root, whose inputs are cast before the compiled step, nor its other
    children), once however often FSDP is applied; none when forward inputs are not cast; a block's own hooks stay."""
    model = FloatResidual()
    theirs = model.blocks[1].register_forward_pre_hook(lambda m, args: None)
    assert cast_inputs_at_blocks(model, MixedPrecision(BF16)) == ["blocks.0", "blocks.1"]
    assert cast_inputs_at_blocks(model, MixedPrecision(BF16)) == ["blocks.0", "blocks.1"]
    hooks = {name: len(m._forward_pre_hooks) for name, m in model.named_modules()}
    assert hooks == {"": 0, "inp": 0, "blocks": 0, "blocks.0": 1, "blocks.0.norm": 0, "blocks.0.lin": 0,
                     "blocks.1": 2, "blocks.1.norm": 0, "blocks.1.lin": 0, "out": 0}, hooks
    h = torch.randn(3, 16)
    args, kwargs = model.blocks[0]._forward_pre_hooks[next(iter(model.blocks[0]._forward_pre_hooks))](
        model.blocks[0], ((h, [h]), h.long()), {"scale": {"s": h}})
    assert (args[0][0].dtype, args[0][1][0].dtype, args[1].dtype, kwargs["scale"]["s"].dtype) == (
        BF16, BF16, torch.int64, BF16)
    assert cast_inputs_at_blocks(model, MixedPrecision(BF16, cast_forward_inputs=False)) == []
    assert [len(b._forward_pre_hooks) for b in model.blocks] == [0, 1]
    theirs.remove()


def test_the_default_reduce_dtype_is_float32_and_none_is_fsdp2s():
    """The stated difference from FSDP2's default (``reduce_dtype=None``, the compute dtype): ours reduces in
    float32 unless told otherwise; None reduces as computed, what FSDP2's default does."""
    assert MixedPrecision(BF16).reduce_dtype is torch.float32
    assert MixedPrecision(BF16).describe().endswith("reduce float32, outputs as computed")
    assert "reduce as computed" in MixedPrecision(BF16, reduce_dtype=None).describe()
