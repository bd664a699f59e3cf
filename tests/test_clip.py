"""Global gradient clipping (``fsdp_pass.clip_grad_norm_``) and the per-unit norm table (``grad_norms``),
2 gloo ranks against one process: the norm is the whole model's, the same on every rank, and training with
clipping follows the reference step for step. One compile per case (three in the no_sync misuse case)."""

import math

import torch

from fsdp_pass import MixedPrecision
from tests import train_cases

TOL = 1e-6  # the bar for the norm; float32 sums in another order


def test_clip_parity_tied_zero3(ranks):
    """A tied GPT-2 (the tied weight counted once), clipping active every step, SGD with momentum."""
    results = ranks(2).run(train_cases.clip_parity, "gpt2_tied", "zero3")
    r = results[0]
    assert max(r["total_rel_err"]) <= TOL and max(r["param_norm_rel_err"]) <= TOL, r
    assert max(r["clipped_grad_rel_err"]) <= 1e-5 and r["param_rel_err"] <= 1e-5, r
    assert r["coefs"][0] < 0.5, r  # it really clipped
    assert all(x["totals"] == r["totals"] for x in results)  # the same number on every rank
    assert "wte" in r["table"] and "total" in r["table"]


def test_clip_parity_frozen_inf_norm_zero2(ranks):
    """The inf norm, frozen parameters (no gradient: they count zero), ZeRO-2, odd shapes' padding rows."""
    r = ranks(2).run(train_cases.clip_parity, "frozen", "zero2", norm_type=math.inf)[0]
    assert max(r["total_rel_err"]) <= TOL and max(r["param_norm_rel_err"]) <= TOL, r
    assert max(r["clipped_grad_rel_err"]) <= 1e-5, r
    r = ranks(2).run(train_cases.clip_parity, "odd_shapes", "zero3", steps=2)[0]
    assert max(r["total_rel_err"]) <= TOL and max(r["clipped_grad_rel_err"]) <= 1e-5, r


def test_clip_with_mixed_precision_and_offload(ranks):
    """bf16 gathers and compute, float32 gradient shards offloaded to the host: the norm of the float32
    gradients, computed where they live."""
    precision = MixedPrecision(torch.bfloat16, output_dtype=torch.float32)
    results = ranks(2).run(
        train_cases.clip_matches_own_full_grads, "llama_gqa", "zero3", mixed_precision=precision, offload_to="cpu"
    )
    r = results[0]
    assert r["total_rel_err"] <= TOL and r["clipped_grad_rel_err"] <= 1e-6, r
    assert r["grad_devices"] == ["cpu"] and r["total_device"] == "cpu"


def test_nonfinite_gradients_are_named_and_misuse_fails_loudly(ranks):
    """The MLP: its step compiles three times here (plain, under no_sync, the flush after it), and any model names
    a poisoned gradient alike; the parity cases above hold the norms of the larger models."""
    results = ranks(2).run(train_cases.nonfinite_and_misuse, "mlp", "zero3")
    for r in results:  # every rank, not only the one whose shard holds the NaN
        victim = r["victim"]
        assert [name for _, name in r["nonfinite"]] == [victim], r
        assert [name for _, name in r["nonfinite_inf_norm"]] == [victim], r
        unit, error = r["victim_unit"], r["errors"]["nonfinite"]
        rows = {line.split()[0]: line.split() for line in r["table"].splitlines()[3:]}  # one short line per unit
        assert rows[unit][3] == "1" and all(row[3] == "-" for name, row in rows.items() if name != unit), r["table"]
        assert max(map(len, r["table"].splitlines())) < 100, r["table"]
        assert f"in 1 of {len(rows)} units: {unit!r} (1 of " in error and victim not in error, error  # counts
        assert "grad_norms" in error and "check_finite=True" in error and len(error) < 700, error
        assert "positive" in r["errors"]["norm_type"]
        assert "no_sync" in r["errors"]["no_sync"]
        assert math.isnan(r["total_without_error"]) and r["after_flush_finite"]
