"""CPU offload (``FSDP(offload_to="cpu")``): shards, gradient shards and optimizer state live on the CPU.

Each unit's shards are copied to the compute device by the op that packs them for the all-gather, and each
gradient shard is copied back by the op that unpacks the reduce-scatter's result. The traces are checked
across devices on this CPU-only machine with a dry run: it computes on the meta device while the shards live
on the CPU, op by op: only the copies read or write a CPU tensor. The executor's copies themselves run here
from CPU tensors to the meta device (the one other device CPU-only torch has; nothing can be copied back from it).
The parity run trains with both on the CPU and asserts where the shards, their gradients and the optimizer's
state are, and (as that alone holds with offload broken too) that its traces copy the shards to the compute device
and back and that explain() counts them on the host; the CUDA run (pinned host shards, copies on the side stream) is tests/test_cuda.py's offloaded case.
"""

import torch
from thunder.core.proxies import TensorProxy

from fsdp_pass import MixedPrecision
from fsdp_pass.predicates import (
    is_all_gather,
    is_bookkeeping,
    is_pack_shards,
    is_reduce_scatter,
    is_unpack_grad_shard,
    is_wait,
)
from fsdp_pass_executors.buffers import pack_shards_impl, unpack_grad_shard_impl
from tests import rank_cases, tolerances
from tests.dry_runs import model_dry_run

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
    # op by op: the packs copy shards off the CPU, the unpacks copy gradient shards back; nothing else touches it
    for trace in (run.forward, run.backward):
        for b in trace.bound_symbols:
            if is_bookkeeping(b):
                continue
            ins, outs = _devices(b.flat_proxy_args), _devices(b.flat_proxy_outs)
            if is_pack_shards(b):
                assert (ins, outs) == ({"cpu"}, {"meta"}), b
            elif is_unpack_grad_shard(b):
                assert (ins, outs) == ({"meta"}, {"cpu"}), b
            else:
                assert ins | outs <= {"meta"}, (b.sym.name, ins, outs)
    (ret,) = [b for b in run.backward.bound_symbols if b.sym.name == "python_return"]
    assert _devices(ret.flat_proxy_args) == {"cpu"}  # every gradient the backward returns is a shard's, on the CPU


def _devices(proxies) -> set[str]:
    return {t.device.device_str() for t in proxies if isinstance(t, TensorProxy)}


def test_the_executor_copies_shards_and_gradient_shards_across_devices():
    """The ``fsdp_comm`` code behind the traces' copies, from CPU tensors to another device (meta): the packed
    buffer and each cut gradient shard are new tensors there, cast on the way; on the CPU, their values."""
    shards = [torch.arange(6.0).reshape(3, 2), torch.arange(3.0)]
    packed = pack_shards_impl(shards, "u", torch.bfloat16, torch.device("meta"))
    assert (packed.device.type, packed.dtype, packed.shape) == ("meta", torch.bfloat16, (9,))
    same_device = pack_shards_impl(shards, "u", torch.bfloat16, None)
    assert torch.equal(same_device, torch.cat([s.reshape(-1) for s in shards]).bfloat16())
    local = torch.arange(9.0, dtype=torch.bfloat16) * 4
    moved = unpack_grad_shard_impl(local.clone(), "u", ((3, 2), (3,)), 4, True, torch.float32, torch.device("meta"))
    assert [(g.device.type, g.dtype, tuple(g.shape)) for g in moved] == [("meta", torch.float32, (3, 2)),
                                                                          ("meta", torch.float32, (3,))]
    here = unpack_grad_shard_impl(local.clone(), "u", ((3, 2), (3,)), 4, True, torch.float32, None)
    assert torch.equal(torch.cat([g.reshape(-1) for g in here]), torch.arange(9.0))  # divided by the 4 ranks


def test_parity_offloaded_with_mixed_precision(ranks):
    """Offload with bf16 gathers (ZeRO-2) against the bf16 reference: identical (0.0 measured)."""
    precision = MixedPrecision(torch.bfloat16, output_dtype=torch.float32)
    results = ranks(2).run(
        rank_cases.parity, "llama_gqa", "zero2", compute_dtype=torch.bfloat16, offload_to="cpu", mixed_precision=precision
    )
    r = results[0]
    assert r["grad_rel_err"] <= tolerances.SAME_CASTS and r["loss_rel_err"] <= tolerances.SAME_CASTS, r  # per parameter
    assert r["losses"][-1] < r["losses"][0]
    for rank, x in enumerate(results):
        assert x["local_loss_rel_err"] <= tolerances.SAME_CASTS, (rank, x)  # this rank's loss on its own slice
        assert x["schedule"] == r["schedule"], (rank, x["schedule"], r["schedule"])
        # where the shards, the gradient shards and AdamW's state live
        where = (x["shard_devices"], x["grad_devices"], x["optimizer_state_devices"])
        assert where == (["cpu"], ["cpu"], ["cpu"]), (rank, where)
        # the step computes on the CPU too, so where they live cannot fail here: the traces must still copy the
        # shards to the compute device at each pack and the gradient shards back at each unpack, and explain()
        # must count the shards, their gradients and the optimizer state on the host, none on the device
        copies = x["copies"]
        assert (copies["pack_to"], copies["unpack_to"]) == (["cpu"], ["cpu"]), (rank, copies)
        before_step, host, offloaded = copies["memory"]
        assert before_step == 0 and host == offloaded > 0, (rank, copies)
