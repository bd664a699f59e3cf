"""8-bit parameter gathers (``MixedPrecision(gather_dtype=torch.int8 | torch.float8_e4m3fn)``).

Tier 1 reads dry runs (meta device, a fake group of 8; one at world 2 under the torchcompile executor): each unit's
one all-gather moves a uint8 buffer of codes and scales that ``quantize_shard`` made from the float32 shards, and
``dequantize_gathered`` turns it into bfloat16 before the parameters are cut out; both ops are ``fsdp_comm``'s,
outside the fusion regions, labelled with what they quantize and the bytes; the gathers move at most 0.55x the
bytes of bfloat16 gathers, and ``explain()``'s floor counts codes and scales. The math on its own: every element
within half a code step of its block's scale. Tier 2 trains on 2 gloo ranks against one process that quantizes
by the documented rule (``tests/quantized_cases.py``): losses, gradients and master weights bitwise equal.
"""

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from thunder.core import utils
from thunder.extend import get_executor

from fsdp_pass import FSDPError, MixedPrecision
from fsdp_pass.op_names import ALL_GATHER, REDUCE_SCATTER
from fsdp_pass.ops.quantize import dequantize_gathered, quantize_shards
from fsdp_pass.plan.quantized_layout import (
    CHUNK_ELEMENTS,
    dequantize_scratch_numel,
    quantize_scratch_bytes,
    quantized_layout,
)
from fsdp_pass.predicates import (
    is_all_gather,
    is_bookkeeping,
    is_dequantize_gathered,
    is_pack_shards,
    is_quantize_shard,
    is_unit_op,
    is_unpack_gathered,
    is_wait,
)
from fsdp_pass.report.dry_run import dry_run
from fsdp_pass.report.measure import allocated_during
from fsdp_pass.report.overlap import overlap_report
from fsdp_pass.report.step_stats import step_stats
from fsdp_pass.text import human_bytes
from fsdp_pass_executors import comm_ex
from tests import explain_cases, quantized_cases, tolerances
from tests.dry_runs import model_dry_run

WORLD = 8
BF16 = torch.bfloat16
# the dry runs gather int8 (float8's trace differs in the codes' dtype alone: its ops run in the parity cases below)
GATHERS = {"int8": torch.int8}


def _precision(gather_dtype=None):
    return MixedPrecision(BF16, output_dtype=torch.float32, gather_dtype=gather_dtype)


@pytest.fixture(scope="module")
def runs():
    """ZeRO-3 dry runs at world 8: bf16 gathers (test_mixed_precision's, shared), int8 gathers."""
    out = {"bf16": model_dry_run(WORLD, "zero3", mixed_precision=_precision())}
    out.update({k: model_dry_run(WORLD, "zero3", mixed_precision=_precision(d)) for k, d in GATHERS.items()})
    return out


def _expected_rank_bytes(shapes, world: int, block: int = 128) -> int:
    """One rank's part of a unit's buffer, from the documented layout: scales (4 B per started block of each
    parameter's rows on the rank), one byte per element, zeros to a multiple of 4."""
    numels = []
    for shape in shapes:
        rows = shape[0] if shape else 1
        numels.append(-(-rows // world) * (torch.Size(shape[1:]).numel() if shape else 1))
    raw = sum(numels) + 4 * sum(-(-n // block) for n in numels)
    return -(-raw // 4) * 4


@pytest.mark.parametrize("name", sorted(GATHERS))
def test_one_gather_per_unit_moves_codes_and_scales(runs, name):
    run, bf16 = runs[name], runs["bf16"]
    plan = run.explanation.plan
    for trace, plain in ((run.forward, bf16.forward), (run.backward, bf16.backward)):
        producers, consumers = utils.producers(trace), utils.consumers(trace)
        gathers = [b for b in trace.bound_symbols if is_all_gather(b)]
        assert len(gathers) == sum(map(is_all_gather, plain.bound_symbols)) > 0  # one collective per unit stays
        assert not any(map(is_pack_shards, trace.bound_symbols))  # no packed float32 copy of the shards
        for g in gathers:
            quantize = producers[g.flat_proxy_args[0]]
            assert is_quantize_shard(quantize), quantize
            assert {str(s.dtype) for s in quantize.args[0]} == {"thunder.dtypes.float32"}  # the master shards
            assert str(g.flat_proxy_args[0].dtype) == "thunder.dtypes.uint8"
            unit = plan.unit_named[quantize.args[1]]
            shapes = [plan.sharding.param(p).layout.shape for p in unit.params]
            assert g.flat_proxy_args[0].numel == _expected_rank_bytes(shapes, WORLD)
            (wait,) = [c for c in consumers[g.output] if is_wait(c)]
            (dequantize,) = [c for c in consumers[wait.output] if not is_bookkeeping(c)]
            (unpack,) = [c for c in consumers[dequantize.output] if not is_bookkeeping(c)]
            assert is_dequantize_gathered(dequantize) and is_unpack_gathered(unpack), (dequantize, unpack)
            assert str(dequantize.output.dtype) == "thunder.dtypes.bfloat16"
            assert all(str(o.dtype) == "thunder.dtypes.bfloat16" for o in unpack.flat_proxy_outs)
            assert quantize.sym.name == "fsdp_quantize_shard" and dequantize.sym.name == "fsdp_dequantize_gathered"
            assert f"to {name} codes with a float32 scale per 128 elements, into its slice of the gathered buffer" in (
                quantize.header), quantize.header
            assert f"B of codes + {4 * quantized_layout(tuple(shapes), WORLD, 128).n_blocks:,} B of" in quantize.header
            assert f"dequantize the gathered {name} codes ({WORLD} ranks x" in dequantize.header
            assert "into bfloat16" in dequantize.header


def _bytes(run, kind):
    return sum(c.full_bytes for c in step_stats(run.forward, run.backward, WORLD).collectives if c.kind == kind)


@pytest.mark.parametrize("name", sorted(GATHERS))
def test_gathers_move_at_most_055x_bf16_and_explain_counts_them(runs, name):
    run, bf16 = runs[name], runs["bf16"]
    assert _bytes(run, ALL_GATHER) <= 0.55 * _bytes(bf16, ALL_GATHER)  # scales and alignment included
    assert _bytes(run, REDUCE_SCATTER) == _bytes(bf16, REDUCE_SCATTER)  # gradients stay in float32
    ours, theirs = run.explanation, bf16.explanation
    owners = ours.plan.sharding.owners()
    gathered = sum(WORLD * (s.layout.shard_numel + 4 * -(-s.layout.shard_numel // 128)) for s in owners)
    assert ours.gathered_param_bytes == gathered <= 0.55 * theirs.gathered_param_bytes
    # what the step holds once gathered is the dequantized parameters, as many bytes as bfloat16 gathers hold
    held = sum(s.nbytes(BF16) for s in owners)
    assert ours.held_param_bytes == held == theirs.held_param_bytes == theirs.gathered_param_bytes
    pieces, plain = (r.fsdp.compiled_step.plan.summary.pieces for r in (run, bf16))
    assert [p.gathered_bytes for p in pieces] == [p.gathered_bytes for p in plain]  # held
    assert sum(p.sent_bytes for p in pieces) <= 0.55 * sum(p.sent_bytes for p in plain)  # sent
    ring = (WORLD - 1) / WORLD
    assert ours.floor_bytes_per_rank == pytest.approx(ring * (gathered + ours.reduced_param_bytes))
    assert ours.bytes_per_rank < theirs.bytes_per_rank
    text = str(ours)
    assert f"mixed precision: gather {name} (a float32 scale per 128 elements), compute bfloat16" in text
    assert f"as gathered ({name} codes and scales; held dequantized: {human_bytes(held)})" in text
    assert "8-bit gathers on one rank" not in text  # at world 8 they save bytes
    alone = dataclasses.replace(ours, plan=dataclasses.replace(
        ours.plan, sharding=dataclasses.replace(ours.plan.sharding, world_size=1)))
    assert f"8-bit gathers on one rank: nothing is sent, so gathering in {name} saves no bytes" in str(alone)


def _quantized(parts, layout, qdtype) -> torch.Tensor:
    """Every rank's part of the gathered buffer, side by side, from each rank's packed shard in ``parts``."""
    return torch.cat([quantize_shards(p.split(list(layout.shard_numels)), layout, qdtype,
                                      torch.empty(layout.rank_bytes, dtype=torch.uint8)) for p in parts])


def test_quantize_and_dequantize():
    """Every element within half a code step of its block's scale (int8) or 2^-4 of itself (float8, normal
    range); an all-zero block stays zero; a NaN makes its block NaN; the buffer's parts stay 4-byte aligned."""
    torch.manual_seed(0)
    shapes, world = ((5, 37), (3,), ()), 3  # 5 and 3 rows over 3 ranks: padding rows; a 0-d parameter
    layout = quantized_layout(shapes, world, 16)
    assert layout.rank_bytes % 4 == 0 and layout.blocks == (-(-2 * 37 // 16), 1, 1)
    parts = [torch.randn(layout.rank_numel) * torch.logspace(-3, 1, layout.rank_numel) for _ in range(world)]
    parts[1][: 2 * 37] = 0.0  # rank 1's rows of the first parameter: all-zero blocks
    for qdtype in (torch.int8, torch.float8_e4m3fn):
        gathered = _quantized(parts, layout, qdtype)
        values = dequantize_gathered(gathered, layout, world, qdtype, torch.float32).view(world, -1)
        for r, p in enumerate(parts):
            offset, block = 0, 0
            for n, nb in zip(layout.shard_numels, layout.blocks):
                for k in range(nb):
                    x = p[offset + 16 * k : offset + min(n, 16 * (k + 1))]
                    got = values[r, offset + 16 * k : offset + min(n, 16 * (k + 1))]
                    scale = x.abs().max() / quantized_cases.QMAX[qdtype]
                    bound = scale / 2 if qdtype == torch.int8 else torch.maximum(x.abs() / 16, scale * 2**-6)
                    assert ((got - x).abs() <= bound * (1 + 1e-6)).all(), (qdtype, r, k)
                offset += n
        assert (values[1, : 2 * 37] == 0).all()
    poisoned = parts[0].clone()
    poisoned[3] = float("nan")
    value = dequantize_gathered(_quantized([poisoned], layout, torch.int8), layout, 1, torch.int8, torch.float32)
    assert value[:16].isnan().all() and not value[16:].isnan().any()  # only its block


def _whole_tensor_quantize(flat, layout, qdtype) -> torch.Tensor:
    """One rank's part of the buffer by the documented rule, each parameter's part of the packed shard ``flat`` at
    once in float32 (what the kernels did before they worked a chunk at a time)."""
    out = torch.zeros(layout.rank_bytes, dtype=torch.uint8)
    scales = out[: layout.scale_bytes].view(torch.float32)
    codes = out[layout.scale_bytes : layout.scale_bytes + layout.rank_numel].view(qdtype)
    offset, first, b, qmax = 0, 0, layout.block, quantized_cases.QMAX[qdtype]
    for n, nb in zip(layout.shard_numels, layout.blocks):
        blocks = F.pad(flat[offset : offset + n].to(torch.float32), (0, nb * b - n)).view(nb, b)
        s = blocks.abs().amax(dim=1) / qmax
        scaled = blocks / torch.where(s > 0, s, torch.ones_like(s))[:, None]
        scaled = scaled.round_().clamp_(-qmax, qmax) if qdtype == torch.int8 else scaled.clamp_(-qmax, qmax)
        scales[first : first + nb], codes[offset : offset + n] = s, scaled.to(qdtype).view(-1)[:n]
        offset, first = offset + n, first + nb
    return out


def _whole_tensor_dequantize(gathered, layout, world, qdtype, dtype) -> torch.Tensor:
    parts = gathered.view(world, layout.rank_bytes)
    scales = parts[:, : layout.scale_bytes].view(torch.float32)
    codes = parts[:, layout.scale_bytes : layout.scale_bytes + layout.rank_numel].view(qdtype).to(torch.float32)
    out, offset, first = [], 0, 0
    for n, nb in zip(layout.shard_numels, layout.blocks):
        per_element = scales[:, first : first + nb].repeat_interleave(layout.block, dim=1)[:, :n]
        out.append((codes[:, offset : offset + n] * per_element).to(dtype))
        offset, first = offset + n, first + nb
    return torch.cat(out, dim=1).view(-1)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaNs in the same places (torch's kernels do not keep a NaN's payload bits alike)."""
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    nan = a.float().isnan()
    return torch.equal(nan, b.float().isnan()) and torch.equal(a[~nan].view(bits), b[~nan].view(bits))


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 1024 elements on the CPU and 4096 on a GPU (2^16 and 2^22 in use), so small shards span several."""
    monkeypatch.setitem(CHUNK_ELEMENTS, "cpu", 1024)
    monkeypatch.setitem(CHUNK_ELEMENTS, "cuda", 4096)
    return CHUNK_ELEMENTS


# (shapes, world, block): padding rows and a 0-d parameter; a shard of three CPU chunks, the last with a short block
# (one GPU chunk); one rank, twelve chunks; blocks of 7 elements
KERNEL_CASES = [(((5, 37), (3,), ()), 3, 16), (((1500, 3), (130,)), 2, 128), (((300, 40),), 1, 128),
                (((33, 7), (1000,)), 4, 7)]


@pytest.mark.parametrize(("shapes", "world", "block"), KERNEL_CASES)
def test_the_chunked_kernels_give_the_whole_tensor_bits(small_chunks, shapes, world, block):
    """The ops work a chunk of blocks at a time; the result is bit for bit what quantizing each parameter's part of
    the shard at once gives: float32 and bfloat16 shards, int8 and float8 codes, dequantized into bfloat16, float16
    and float32 by the CPU's kernels and by the GPU's (run here on the CPU: one ``mul`` with the output cast for
    int8, the codes copied and multiplied in place for float8), on random values over six decades with all-zero
    blocks and a -0.0; with a NaN and infinities, the same elements come out NaN."""
    layout = quantized_layout(shapes, world, block)
    g = torch.Generator().manual_seed(0)
    for shard_dtype, poisoned in ((torch.float32, False), (torch.bfloat16, False), (torch.float32, True)):
        parts = []
        for r in range(world):
            p = torch.randn(layout.rank_numel, generator=g) * torch.logspace(-4, 2, layout.rank_numel)
            p[: min(300, layout.rank_numel)] = 0.0
            p[min(310, layout.rank_numel - 1)] = -0.0
            if poisoned and r == world - 1:
                p[5 % layout.rank_numel], p[700 % layout.rank_numel], p[-1] = float("nan"), float("inf"), -float("inf")
            parts.append(p.to(shard_dtype))
        for qdtype in (torch.int8, torch.float8_e4m3fn):
            gathered = _quantized(parts, layout, qdtype)
            reference = torch.cat([_whole_tensor_quantize(p, layout, qdtype) for p in parts])
            assert poisoned or torch.equal(gathered, reference), (shard_dtype, qdtype)
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                expected = _whole_tensor_dequantize(reference, layout, world, qdtype, dtype)
                for device_type in ("cpu", "cuda"):
                    got = dequantize_gathered(gathered, layout, world, qdtype, dtype, device_type=device_type)
                    assert _same_bits(got, expected), (shard_dtype, qdtype, dtype, device_type, poisoned)


def test_the_kernels_hold_a_chunk_of_float32_not_a_shard(small_chunks):
    """On the CPU (torch's profiler sees every allocation): quantizing allocates nothing but its scratch, and
    dequantizing its output and its scratch, exactly what the memory model counts (``scratch_bytes``); for a shard
    of 4x the chunk, the scratch is a quarter or less of the float32 copy of the shard (of every rank's part, when
    dequantizing) that the ops used to make (three of them when quantizing)."""
    shapes, world = ((4 * small_chunks["cpu"], 2), (40,)), 2
    layout = quantized_layout(shapes, world, 128)
    shards = [torch.randn(n) for n in layout.shard_numels]
    mine = torch.empty(layout.rank_bytes, dtype=torch.uint8)
    quantized = allocated_during(lambda: quantize_shards(shards, layout, torch.int8, mine)).peak_bytes
    assert abs(quantized - quantize_scratch_bytes(layout, "cpu")) <= 16  # (scalars torch wraps as tensors)
    assert quantize_scratch_bytes(layout, "cpu") < 0.26 * 4 * layout.shard_numels[0]
    gathered = torch.empty(world * layout.rank_bytes, dtype=torch.uint8)
    for dtype in (torch.bfloat16, torch.float32):
        scratch = 4 * dequantize_scratch_numel(layout, world, dtype, "cpu")
        output = world * layout.rank_numel * dtype.itemsize
        measured = allocated_during(lambda: dequantize_gathered(gathered, layout, world, torch.int8, dtype)).peak_bytes
        assert measured == output + scratch, (dtype, measured, output, scratch)
        assert scratch <= 0.26 * 4 * world * layout.shard_numels[0]
    assert dequantize_scratch_numel(layout, world, torch.bfloat16, "cuda") == 0  # one kernel, casting as it stores


# (strategy, gather dtype, compute dtype): dequantized into bfloat16 (the CPU's kernels through their scratch) and into
# float32 (in place); the step model is held to 1 % of the traces in float32 elsewhere (test_auto_plan), and in
# bfloat16 misses float32 upcasts the functional trace does not show (ZeRO-3 with 8-bit gathers 1.6 % above, at a
# unit's unpack in the backward: bench/quantized_gathers.py)
MEASURED = [("zero2", torch.float8_e4m3fn, BF16), ("zero3", torch.int8, None)]


@pytest.mark.parametrize(("strategy", "gather_dtype", "param_dtype"), MEASURED,
                         ids=[f"{s}-{str(d).removeprefix('torch.')}-{str(p).removeprefix('torch.')}"
                              for s, d, p in MEASURED])
def test_a_real_steps_peak_is_explains_and_the_step_models(ranks, strategy, gather_dtype, param_dtype):
    """On 2 gloo ranks, explain()'s model with 8-bit gathers: each all-gather fills the buffer its quantize op
    allocated and wrote its slice of (no send buffer); every measured step's allocations peak within explain()'s
    usual 1 KiB of the traced step peak (the received codes, the dequantized parameters and the ops' scratch all
    counted; before, ZeRO-3 in bfloat16 measured 39 KiB above it: the float32 copies), and the step model, which
    holds the dequantized parameters (it held the codes: 6 % below the traces), within 1 % of the traced peak;
    explain()'s text names the codes and scales sent and the dequantized parameters held."""
    for rank, r in enumerate(ranks(2).run(quantized_cases.measured_step, strategy, gather_dtype, param_dtype)):
        assert r["in_place"] and all(r["in_place"]), (rank, r["in_place"])
        assert all(abs(p - r["traced_step"]) <= tolerances.PEAK_BYTES for p in r["measured"]), (
            rank, r["measured"], r["traced_step"])
        assert 0.99 * r["traced"] <= r["predicted"] <= 1.01 * r["traced"], (rank, r["predicted"], r["traced"])
        # explain() of the real step says what is sent and what is held: the floor's codes and scales, the parameters
        # held dequantized in the compute dtype, and at the gathered peak the dequantized buffers, not the codes
        name = str(gather_dtype).removeprefix("torch.")
        assert f"as gathered ({name} codes and scales; held dequantized: {human_bytes(r['held'])})" in r["text"], (
            r["text"])
        assert "of dequantized buffers (unit" in r["text"], r["text"]


def test_check_finite_reads_the_shards_an_8bit_gather_quantizes(ranks):
    """``check_finite=True`` with int8 gathers: there is no packed shard; the parameters' check follows each unit's
    ``quantize_shard`` and reads the shards it quantized, so an inf planted in rank 1's shard of fc2's weight is
    named there (the parameter, rank 1), not later in its output."""
    results = ranks(2).run(quantized_cases.inf_in_a_shard)
    for r in results:
        assert r["clean"] == "ok", r["clean"]
        message = r["poisoned"]
        assert ("first (in execution order) in parameter 'fc2.weight' (module 'fc2', unit 'fc2'): this rank's shard"
                in message), message
        assert "in the forward, on rank 1." in message, message
    assert results[0]["poisoned"] == results[1]["poisoned"]


def test_bad_gather_options():
    with pytest.raises(FSDPError, match="gather_dtype"):
        MixedPrecision(BF16, gather_dtype=torch.float16)
    with pytest.raises(FSDPError, match="gather_block"):
        MixedPrecision(BF16, gather_dtype=torch.int8, gather_block=0)


@functools.cache
def _fused_dry_run():
    executors = [comm_ex, get_executor("torchcompile"), get_executor("torch")]
    return dry_run(*explain_cases.build_model("meta"), 2, "zero3", executors=executors,
                   mixed_precision=_precision(torch.int8), offload_to="cpu", units="blocks")


def test_quantize_and_dequantize_stay_out_of_fusion_regions():
    """Under torchcompile (which fuses CPU tensors too), offloaded: the new ops are top-level ``fsdp_comm`` ops,
    and every forward gather but the first still overlaps compute."""
    run = _fused_dry_run()
    for trace in (run.forward, run.backward):
        fused = [s for b in trace.bound_symbols if b.sym.is_fusion for s in b.subsymbols]
        assert fused and not any(is_unit_op(s) for s in fused)
        names = [b.sym.name for b in trace.bound_symbols]
        assert names.count("fsdp_quantize_shard") == names.count("fsdp_all_gather") > 0
        assert names.count("fsdp_dequantize_gathered") == names.count("fsdp_all_gather")
    forward = [r for r in overlap_report(run.forward, run.backward).rows if r.phase == "forward"]
    assert forward and not any(r.exposed for r in forward[1:])


# (model, strategy, gather dtype, options): padding rows and a 0-d parameter (odd_shapes), a tied parameter in one
# unit (FSDP packs and reduces each use: tied_mlp), frozen parameters with the shards offloaded, HSDP (2 replicas
# of a shard group of 1); ZeRO-2 and ZeRO-3; both dtypes
PARITY = [
    ("tied_mlp", "zero3", torch.int8, {}),
    ("odd_shapes", "zero2", torch.float8_e4m3fn, {}),
    ("frozen", "zero3", torch.int8, {"offload_to": "cpu"}),
    ("mlp", "zero3", torch.float8_e4m3fn, {"mesh_shape": (2, 1)}),
]


@pytest.mark.parametrize(("model_name", "strategy", "gather_dtype", "options"), PARITY,
                         ids=[f"{m}-{s}-{str(d).removeprefix('torch.')}" for m, s, d, _ in PARITY])
def test_trains_bitwise_like_one_process_that_quantizes_the_same_way(ranks, model_name, strategy, gather_dtype,
                                                                     options):
    results = ranks(2).run(quantized_cases.quantized_parity, model_name, strategy, gather_dtype, steps=2, **options)
    for rank, r in enumerate(results):
        assert not any(r["loss_differs"]), (rank, r["losses"])  # each rank's own loss, every step
        assert r["grad_differs"] == [[]] * len(r["loss_differs"]), (rank, r["grad_differs"])  # every gradient
        assert r["params_differ"] == [] and r["frozen_grads"] == [], (rank, r)  # master weights after AdamW
        assert r["rounded"] > 0  # the gather rounds values a plain bfloat16 gather would not
        assert "fsdp_quantize_shard" in r["forward"] and "fsdp_dequantize_gathered" in r["forward"]
    shard_ranks = options.get("mesh_shape", (1, 2))[1]
    assert all(n % (4 * shard_ranks) == 0 for n in results[0]["gather_bytes"]), results[0]["gather_bytes"]
