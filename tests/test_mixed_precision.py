"""Mixed precision (``FSDP(mixed_precision=...)``): gathers move the compute dtype, the optimizer keeps float32.

Tier 1 reads dry-run traces (meta device, fake group of 8); tier 2 trains on gloo ranks against a
single-process reference that makes the same casts: each rank's micro-batch through a bfloat16 copy of the
float32 model, jitted by plain Thunder (so both sides round the same decomposed ops), gradients averaged in
the reduce dtype into float32 master weights.
"""

import pytest
import torch

from fsdp_pass import FSDPError, MixedPrecision
from fsdp_pass.report.dry_run import dry_run
from fsdp_pass.predicates import (
    is_all_gather,
    is_bookkeeping,
    is_pack_grads,
    is_pack_shards,
    is_reduce_scatter,
    is_unpack_grad_shard,
    is_wait,
)
from fsdp_pass.report.step_stats import step_stats
from fsdp_pass.op_names import ALL_GATHER, REDUCE_SCATTER
from tests import autocast_cases, explain_cases, models, rank_cases, tolerances
from tests.dry_runs import model_dry_run

WORLD = 8
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def runs():
    """ZeRO-3 dry runs: full precision, bf16 gathers with a float32 reduce, bf16 gathers and reduce."""
    specs = {
        "fp32": None,
        "bf16": MixedPrecision(BF16, output_dtype=torch.float32),
        "bf16_reduce": MixedPrecision(BF16, reduce_dtype=BF16, output_dtype=torch.float32),
    }
    return {k: model_dry_run(WORLD, "zero3", **({"mixed_precision": v} if v else {})) for k, v in specs.items()}


def _bytes(run, kind):
    return sum(c.full_bytes for c in step_stats(run.forward, run.backward, WORLD).collectives if c.kind == kind)


def test_gathers_move_half_the_bytes(runs):
    assert _bytes(runs["bf16"], ALL_GATHER) * 2 == _bytes(runs["fp32"], ALL_GATHER)
    assert _bytes(runs["bf16"], REDUCE_SCATTER) == _bytes(runs["fp32"], REDUCE_SCATTER)  # float32 reduce
    assert _bytes(runs["bf16_reduce"], REDUCE_SCATTER) * 2 == _bytes(runs["fp32"], REDUCE_SCATTER)
    fp32, bf16 = runs["fp32"].explanation, runs["bf16_reduce"].explanation
    assert bf16.bytes_per_rank * 2 == pytest.approx(fp32.bytes_per_rank)
    # the floor counts the dtypes that move: 2 bytes a parameter gathered, 4 or 2 reduced
    ring, params = (WORLD - 1) / WORLD, fp32.param_bytes  # float32: 4 bytes a parameter
    assert fp32.floor_bytes_per_rank == pytest.approx(ring * (params + params))
    assert runs["bf16"].explanation.floor_bytes_per_rank == pytest.approx(ring * (params / 2 + params))
    assert bf16.floor_bytes_per_rank == pytest.approx(ring * (params / 2 + params / 2))
    assert bf16.textbook_bytes_per_rank == pytest.approx(ring * 3 * params / 2)
    assert "as gathered" in str(runs["bf16"].explanation) and "as gathered" not in str(fp32)


def test_the_shard_is_cast_before_its_gather(runs):
    for trace in (runs["bf16"].forward, runs["bf16"].backward):
        producers = {b.output.name: b for b in trace.bound_symbols if hasattr(b.output, "name")}
        gathers = [b for b in trace.bound_symbols if is_all_gather(b)]
        assert gathers
        for g in gathers:
            cast = producers[g.flat_proxy_args[0].name]  # the op that packs the shards casts them too
            assert is_pack_shards(cast), cast
            assert {str(s.dtype) for s in cast.args[0]} == {"thunder.dtypes.float32"}
            assert str(g.flat_proxy_args[0].dtype) == "thunder.dtypes.bfloat16"
            assert "cast the shards from float32 to bfloat16 before the all-gather" in str(cast.header)
    # the reduce-scatter runs in the reduce dtype: float32 by default
    scatters = [b for b in runs["bf16"].backward.bound_symbols if is_reduce_scatter(b)]
    assert scatters and {str(b.flat_proxy_args[0].dtype) for b in scatters} == {"thunder.dtypes.float32"}
    assert "cast the gradients from bfloat16 to float32 before the reduce-scatter" in str(runs["bf16"].backward)


def test_compute_runs_in_bf16(runs):
    linears = [b for b in runs["bf16"].forward.bound_symbols if str(b.sym.name) in ("linear", "matmul")]
    assert linears and all(str(b.output.dtype) == "thunder.dtypes.bfloat16" for b in linears)
    # the optimizer steps on float32 shards: the backward returns float32 gradients for them
    (ret,) = [b for b in runs["bf16"].backward.bound_symbols if b.sym.name == "python_return"]
    grads = [g for g in ret.args[0] if g is not None]
    assert grads and all(str(g.dtype) == "thunder.dtypes.float32" for g in grads)
    assert "mixed precision: gather+compute bfloat16, floating inputs cast to it, reduce float32, outputs float32" in str(runs["bf16"].explanation)


def _divisions_around_reduce_scatters(trace):
    """(whether the op packing each reduce-scatter's buffer divides it, whether the op unpacking its result
    divides that), per reduce-scatter."""
    producers = {b.output.name: b for b in trace.bound_symbols if hasattr(b.output, "name")}
    readers = {}
    for b in trace.bound_symbols:
        for p in b.flat_proxy_args:
            readers.setdefault(p.name, []).append(b)
    scatters = [b for b in trace.bound_symbols if is_reduce_scatter(b)]
    packs = [producers[s.flat_proxy_args[0].name] for s in scatters]
    assert all(is_pack_grads(p) for p in packs)
    before = [p.args[5] for p in packs]  # pack_grads(grads, unit, shapes, world size, dtype, divide_first)
    (waits,) = zip(*[[w for w in readers[s.output.name] if is_wait(w)] for s in scatters])
    unpacks = [r for w in waits for r in readers[w.output.name] if not is_bookkeeping(r)]
    assert len(unpacks) == len(waits) and all(is_unpack_grad_shard(u) for u in unpacks)
    after = [u.args[4] for u in unpacks]  # unpack_grad_shard(local, unit, shapes, world size, divide, ...)
    return before, after


def test_the_reduced_shard_is_divided_except_in_float16(runs):
    """The mean over ranks is taken on the shard after the reduce-scatter (1/N of the bytes, no full-size
    copy); float16 gradients are divided before it, as their sum could overflow."""
    before, after = _divisions_around_reduce_scatters(runs["bf16_reduce"].backward)
    assert before and not any(before) and all(after)
    fp16 = MixedPrecision(torch.float16, reduce_dtype=torch.float16)
    module = models.build("mlp").to("meta")
    x, _ = models.batch("mlp", 8, 0)
    run = dry_run(module, (x.to("meta"),), WORLD, "zero2", mixed_precision=fp16)
    before, after = _divisions_around_reduce_scatters(run.backward)
    assert before and all(before) and not any(after)
    assert "before the reduce-scatter sums them (float16's range)" in str(run.backward)


def test_bad_mixed_precision():
    with pytest.raises(FSDPError, match="param_dtype"):
        MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(FSDPError, match="mixed_precision"):
        dry_run(*explain_cases.build_model("meta"), WORLD, "zero3", mixed_precision="bf16")


TOL_SAME_CASTS = tolerances.SAME_CASTS  # measured 0.0: a float32 reduce of bf16 gradients, the same casts
TOL_BF16_REDUCE = 2e-2  # gloo's bf16 sum rounds differently from torch's; losses and gradients drift apart over
# 5 AdamW steps: measured 0.9 % (all gradients as one vector), 2.2 % (the worst parameter, a LayerNorm bias)
TOL_BF16_REDUCE_PER_PARAMETER = 5e-2


@pytest.mark.parametrize(
    ("model_name", "strategy", "reduce_dtype"), [("llama_gqa", "zero3", torch.float32), ("gpt2_tied", "zero2", BF16)]
)
def test_parity_with_mixed_precision(ranks, model_name, strategy, reduce_dtype):
    precision = MixedPrecision(BF16, reduce_dtype=reduce_dtype, output_dtype=torch.float32)
    results = ranks(2).run(
        rank_cases.parity, model_name, strategy, compute_dtype=BF16, reduce_dtype=reduce_dtype, mixed_precision=precision
    )
    r = results[0]
    if reduce_dtype == torch.float32:  # the same casts: every parameter's gradient, every step
        tol = TOL_SAME_CASTS
        assert r["grad_rel_err"] <= tol, r
    else:  # every parameter's gradient at the first step within two bfloat16 roundings of the reduce; then drift
        tol = TOL_BF16_REDUCE
        assert r["grad_rel_err_by_step"][0] <= tolerances.ulps_of_reduce(BF16), r
        assert r["grad_rel_err"] <= TOL_BF16_REDUCE_PER_PARAMETER and r["grad_norm_rel_err"] <= tol, r
    assert r["loss_rel_err"] <= tol, r
    # the casts are real: float32 gradients are farther from this reference (by > 0.1 %) than ours are
    assert r["full_precision_grad_norm_rel_err"] > max(r["grad_norm_rel_err"], 1e-3), r
    assert r["losses"][-1] < r["losses"][0]
    for rank, x in enumerate(results):  # each rank's own loss against the reference's on its slice
        assert x["local_loss_rel_err"] <= tol, (rank, x)


def test_float16_gradients_are_divided_before_a_sum_that_would_overflow(ranks):
    """float16 parameters and reduce on 2 ranks that hold the same batch, the loss scaled so that each rank's
    largest gradient element is about 48,000: it fits in float16 (65,504 at most), the two ranks' sum (96,000)
    would not. Divided by the 2 ranks before the reduce-scatter, every gradient is finite and equals the
    reference's, which pre-divides in float16 too."""
    results = ranks(2).run(rank_cases.float16_reduce_near_its_range, "mlp", "zero2")
    r = results[0]
    largest = r["largest_low_precision_grad"]
    assert torch.finfo(torch.float16).max / 2 < largest < torch.finfo(torch.float16).max, r  # the sum would overflow
    assert all(e <= TOL_SAME_CASTS for e in r["grad_rel_err_by_param"].values()), r  # finite, and each as the reference's
    assert r["loss_rel_err"] <= TOL_SAME_CASTS, r
    for rank, x in enumerate(results):
        assert x["local_loss_rel_err"] <= TOL_SAME_CASTS, (rank, x)


def test_torch_autocast_trains_as_one_process_does(ranks):
    """Float32 parameters under ``torch.autocast``: Thunder's autocast casts the gathered float32 parameters at each
    matmul, as it does for the whole model in one process (the gathers move float32: MixedPrecision moves half)."""
    results = ranks(2).run(autocast_cases.autocast_parity, "llama_gqa", "zero3")
    for r in results:
        assert r["out_dtypes"] == ["torch.bfloat16"], r  # autocast did compute the head in bfloat16
        assert r["shard_dtypes"] == ["torch.float32"], r
        assert r["loss_rel_err"] <= TOL_SAME_CASTS and r["param_rel_err"] <= 1e-5, r
