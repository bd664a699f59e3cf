"""The ``fsdp_comm`` executor's torch code for a quantized gather's ops (:mod:`fsdp_pass.ops.quantized_gather`).

In a printed execution trace they read ``fsdp_quantize_shard`` and ``fsdp_dequantize_gathered``; being this
executor's ops, no fusion executor takes them into a fusion region. The math is
:mod:`fsdp_pass.ops.quantize`'s; what this adds is where it runs:

1. Quantizing allocates the whole gathered buffer (on the compute stream, which reads it after the wait, as
   packing does: :mod:`fsdp_pass_executors.buffers`), writes this rank's slice of it and hands the slice on with the
   buffer as its ``GATHERED_BUFFER`` attribute: the all-gather fills the buffer in place around it
   (:mod:`fsdp_pass_executors.collectives`). On CUDA it runs on the communication stream after that waits for the
   compute stream (as an offloaded shard's copy to the GPU does, and the all-gather that follows): it reads shards
   the compute stream's optimizer wrote, and the all-gather, issued on the same stream next, reads what it writes.
   Its float32 scratch is allocated on that stream, so the allocator hands that memory on only in stream order.
2. Dequantizing runs where the wait left the compute stream: after the all-gather.
"""

from __future__ import annotations

import torch
from fsdp_pass_executors.collectives import GATHERED_BUFFER, comm_ex, communication_stream
from thunder.core.dtypes import to_torch_dtype

from fsdp_pass.op_names import DEQUANTIZE_GATHERED_OP, QUANTIZE_SHARD_OP
from fsdp_pass.ops import quantized_gather as qg
from fsdp_pass.ops.quantize import dequantize_gathered, quantize_shards
from fsdp_pass.plan.quantized_layout import quantized_layout


def quantize_shard_impl(shards, unit: str, full_shapes, world_size: int, qdtype, block: int, device, group):
    layout = quantized_layout(full_shapes, world_size, block)
    qdtype, device = to_torch_dtype(qdtype), shards[0].device if device is None else torch.device(str(device))
    gathered = torch.empty(world_size * layout.rank_bytes, dtype=torch.uint8, device=device)  # compute stream
    rank = group.rank()
    mine = gathered[rank * layout.rank_bytes : (rank + 1) * layout.rank_bytes]
    setattr(mine, GATHERED_BUFFER, gathered)
    if device.type != "cuda":
        return quantize_shards(shards, layout, qdtype, mine)
    compute, comm = torch.cuda.current_stream(device), communication_stream(device)
    comm.wait_stream(compute)
    with torch.cuda.stream(comm):
        return quantize_shards(shards, layout, qdtype, mine)


def dequantize_gathered_impl(gathered: torch.Tensor, unit: str, full_shapes, world_size: int, qdtype, block: int,
                             dtype):
    layout = quantized_layout(full_shapes, world_size, block)
    return dequantize_gathered(gathered, layout, world_size, to_torch_dtype(qdtype), to_torch_dtype(dtype))


for _prim, _name, _impl in (
    (qg.quantize_shard, QUANTIZE_SHARD_OP, quantize_shard_impl),
    (qg.dequantize_gathered, DEQUANTIZE_GATHERED_OP, dequantize_gathered_impl),
):
    comm_ex.register_implementation(_prim, comm_ex.register_operator(_name, meta=_prim.meta, fn=_impl))
