"""CPU offload (``FSDP(offload_to="cpu")``): shards, gradient shards and optimizer state live on the CPU.

Each unit's shards are copied to the compute device by the op that packs them for the all-gather, and each
gradient shard is copied back by the op that unpacks the reduce-scatter's result. The traces are checked
across devices on this CPU-only machine with a dry run: it computes on the meta device while the shards live
on the CPU. The parity run trains with both on the CPU; the CUDA run (pinned host shards, copies on the
side stream) is in the README's GPU table.
"""

import torch

from fsdp_pass import MixedPrecision
from fsdp_pass.predicates import (
    is_all_gather,
    is_bookkeeping,
    is_pack_shards,
    is_reduce_scatter,
    is_unpack_grad_shard,
    is_wait,
)
from tests import rank_cases
from tests.dry_runs import model_dry_run
from tests.test_mixed_precision import TOL_SAME_CASTS

WORLD = 8


def test_copies_before_each_gather_and_after_each_reduce_scatter():
    """Shards on the CPU, compute on another device (meta, in this dry run): the traces cross devices."""
    plain = model_dry_run(WORLD, "zero3")
    run = model_dry_run(WORLD, "zero3", offload_to="cpu")
    for trace in (run.forward, run.backward):
        producers = {b.output.name: b for b in trace.bound_symbols if hasattr(b.output, "name")}
        for g in (b for b in trace.bound_symbols if is_all_gather(b)):
            copy = producers[g.flat_proxy_args[0].name]
            assert is_pack_shards(copy) and "copy the shards from cpu to meta" in str(copy.header), copy
            assert {s.device.device_str() for s in copy.args[0]} == {"cpu"} and g.output.device.device_str() == "meta"
    consumers = {}
    for b in run.backward.bound_symbols:
        for a in [] if is_bookkeeping(b) else b.flat_proxy_args:
            consumers.setdefault(a.name, []).append(b)
    futures = {b.output.name for b in run.backward.bound_symbols if is_reduce_scatter(b)}
    waits = [b for b in run.backward.bound_symbols if is_wait(b) and b.args[0].name in futures]
    assert waits
    for w in waits:
        (back,) = consumers[w.output.name]  # divided by the world size, then copied back to the shards
        assert is_unpack_grad_shard(back), back
        assert "copy the gradient shard from meta to cpu for the optimizer" in str(back.header), back
        assert {g.device.device_str() for g in back.flat_proxy_outs} == {"cpu"}
    # the same collectives, and the explanation counts shards and optimizer state off the device
    assert [b.sym.name for b in run.backward.bound_symbols if is_all_gather(b) or is_reduce_scatter(b)] == [
        b.sym.name for b in plain.backward.bound_symbols if is_all_gather(b) or is_reduce_scatter(b)
    ]
    m = run.explanation.memory
    assert m.before_step == 0 and m.host == m.sharded_params + m.optimizer_state + m.gradient_shards > 0
    assert "offload: shards, gradient shards and optimizer state live on cpu" in str(run.explanation)


def test_parity_offloaded_with_mixed_precision(ranks):
    """Offload with bf16 gathers (ZeRO-2) against the bf16 reference: identical (0.0 measured)."""
    precision = MixedPrecision(torch.bfloat16, output_dtype=torch.float32)
    results = ranks(2).run(
        rank_cases.parity, "llama_gqa", "zero2", compute_dtype=torch.bfloat16, offload_to="cpu", mixed_precision=precision
    )
    r = results[0]
    assert r["grad_norm_rel_err"] <= TOL_SAME_CASTS and r["loss_rel_err"] <= TOL_SAME_CASTS, r
    assert r["losses"][-1] < r["losses"][0]
    assert all(x["losses"] == r["losses"] for x in results)
    assert all(x["schedule"] == r["schedule"] for x in results)
