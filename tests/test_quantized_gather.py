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
from thunder.core import utils
from thunder.extend import get_executor

from fsdp_pass import FSDPError, MixedPrecision
from fsdp_pass.op_names import ALL_GATHER, REDUCE_SCATTER
from fsdp_pass.ops.quantize import dequantize_gathered, quantize_shard
from fsdp_pass.plan.quantized_layout import quantized_layout
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
from fsdp_pass.report.overlap import overlap_report
from fsdp_pass.report.step_stats import step_stats
from fsdp_pass_executors import comm_ex
from tests import explain_cases, quantized_cases
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
        for g in gathers:
            quantize = producers[g.flat_proxy_args[0]]
            pack = producers[quantize.flat_proxy_args[0]]
            assert is_quantize_shard(quantize) and is_pack_shards(pack), (quantize, pack)
            assert pack.args[2] is None and {str(s.dtype) for s in pack.args[0]} == {"thunder.dtypes.float32"}
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
            assert f"to {name} codes with a float32 scale per 128 elements" in quantize.header, quantize.header
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
    ring = (WORLD - 1) / WORLD
    assert ours.floor_bytes_per_rank == pytest.approx(ring * (gathered + ours.reduced_param_bytes))
    assert ours.bytes_per_rank < theirs.bytes_per_rank
    text = str(ours)
    assert f"mixed precision: gather {name} (a float32 scale per 128 elements), compute bfloat16" in text
    assert "as gathered" in text
    assert "8-bit gathers on one rank" not in text  # at world 8 they save bytes
    alone = dataclasses.replace(ours, plan=dataclasses.replace(
        ours.plan, sharding=dataclasses.replace(ours.plan.sharding, world_size=1)))
    assert f"8-bit gathers on one rank: nothing is sent, so gathering in {name} saves no bytes" in str(alone)


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
        gathered = torch.cat([quantize_shard(p, layout, qdtype) for p in parts])
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
    value = dequantize_gathered(quantize_shard(poisoned, layout, torch.int8), layout, 1, torch.int8, torch.float32)
    assert value[:16].isnan().all() and not value[16:].isnan().any()  # only its block


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
