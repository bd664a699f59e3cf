"""Inputs checked where they enter (issue 38 item 3): each mistake an FSDPError naming the argument, before any compile.

Tier 1 (one process, a fake group of 2 ranks): the checks before the compiled step (meta, another device) run before
Thunder looks at the call; the trace's failures (float ids, float64 into a float32 model) are named when Thunder fails
to trace, before the pass sees a trace (nothing is compiled); an int32 ``labels`` that a loss needs as int64 is
named by the pass before the backward is derived. Tier 2 (2 gloo ranks): int32 ids train as int64 ids do.
"""

from __future__ import annotations

import pytest
import thunder
import torch

from fsdp_pass import FSDP, FSDPError, MixedPrecision, fake_process_group, fsdp_of
from tests import input_cases, models


def _jit(model, **options):
    return thunder.jit(model, transforms=[FSDP("zero3", **options)])


def _traced(jm) -> int:
    """How many times Thunder began tracing the call (its cache misses)."""
    return thunder.cache_misses(jm)


def test_meta_or_misplaced_input_is_named_before_thunder_sees_the_call():
    with fake_process_group(2):
        jm = _jit(models.build("llama_gqa"))
        ids = models.batch("llama_gqa", 2, 0)[0]
        with pytest.raises(FSDPError, match=r"argument 0 \(idx\) is on the meta device") as meta:
            jm(ids.to("meta"))
        assert "computes on cpu" in str(meta.value) and _traced(jm) == 0
        with torch.device("meta"):
            on_meta = models.MODELS["mlp"]()
        jm = _jit(on_meta, device="meta")  # the shards and the step on meta, as in a dry run
        with pytest.raises(FSDPError, match=r"argument 0 \(x\) is on cpu, and the step computes on meta") as moved:
            jm(models.batch("mlp", 2, 0)[0])
        assert ".to('meta')" in str(moved.value) and _traced(jm) == 0


def test_float_ids_and_float64_inputs_are_named_when_tracing_fails():
    with fake_process_group(2):
        ids = input_cases.ids()
        jm = _jit(input_cases.IdsToLoss())
        with pytest.raises(FSDPError, match=r"keyword argument input_ids is float32 and holds whole numbers") as floats:
            jm(input_ids=ids.float(), labels=ids)
        assert "integer dtype" in str(floats.value) and "ids.long()" in str(floats.value)  # Thunder's words, the fix
        assert isinstance(floats.value.__cause__, RuntimeError) and fsdp_of(jm).compiled_step is None  # not compiled

        jm = _jit(models.build("mlp"))
        x = models.batch("mlp", 2, 0)[0]
        with pytest.raises(FSDPError, match=r"argument 0 \(x\) is float64, and the model computes in float32") as f64:
            jm(x.double())
        assert "MixedPrecision" in str(f64.value) and fsdp_of(jm).compiled_step is None
        with pytest.raises(RuntimeError) as shape:  # a failure the inputs do not explain goes up as Thunder said it
            jm(x[:, :7])
        assert not isinstance(shape.value, FSDPError)


def test_float64_input_is_cast_under_mixed_precision():
    """FSDP2's semantics: MixedPrecision casts floating inputs to param_dtype, so a float64 batch is fine."""
    with fake_process_group(2):
        jm = _jit(models.build("mlp"), mixed_precision=MixedPrecision(torch.bfloat16))
        out = jm(models.batch("mlp", 2, 0)[0].double())
        assert out.dtype == torch.bfloat16


def test_int32_labels_named_before_the_backward_is_derived():
    with fake_process_group(2):
        jm = _jit(input_cases.IdsToLoss())
        ids = input_cases.ids()
        with pytest.raises(FSDPError, match="keyword argument labels is int32") as int32:
            jm(ids.int(), labels=ids.int())
        assert "cross_entropy" in str(int32.value) and ".long()" in str(int32.value)
        assert fsdp_of(jm).compiled_step is None  # raised by the pass's first stage: nothing derived or compiled


def test_int32_ids_train_as_int64_ids(ranks):
    for r in ranks(2).run(input_cases.int32_ids_train_as_int64):
        assert r["loss_diff"] == 0.0 and r["weight_diff"] == 0.0 and r["trained"] > 0, r
