"""The ``fsdp_comm`` executor's torch code for a quantized gather's ops (:mod:`fsdp_pass.ops.quantized_gather`).

In a printed execution trace they read ``fsdp_quantize_shard`` and ``fsdp_dequantize_gathered``; being this
executor's ops, no fusion executor takes them into a fusion region. The math is
:mod:`fsdp_pass.ops.quantize`'s; what this adds is where it runs:

1. Quantizing, on CUDA, runs on the communication stream after it waits for the compute stream (as an
   offloaded shard's copy to the GPU does, and the all-gather that follows): it reads a buffer either stream
   may have written, and the all-gather, issued on the same stream next, reads what it writes. The packed
   shard is recorded on that stream, so the allocator does not hand its memory to the compute stream while
   the quantization still reads it.
2. Dequantizing runs where the wait left the compute stream: after the all-gather.
"""

from __future__ import annotations

import torch
from fsdp_pass_executors.collectives import comm_ex, communication_stream
from thunder.core.dtypes import to_torch_dtype

from fsdp_pass.op_names import DEQUANTIZE_GATHERED_OP, QUANTIZE_SHARD_OP
from fsdp_pass.ops import quantized_gather as qg
from fsdp_pass.ops.quantize import dequantize_gathered, quantize_shard
from fsdp_pass.plan.quantized_layout import quantized_layout


def quantize_shard_impl(flat: torch.Tensor, unit: str, full_shapes, world_size: int, qdtype, block: int):
    layout = quantized_layout(full_shapes, world_size, block)
    qdtype = to_torch_dtype(qdtype)
    if not flat.is_cuda:
        return quantize_shard(flat, layout, qdtype)
    compute, comm = torch.cuda.current_stream(flat.device), communication_stream(flat.device)
    comm.wait_stream(compute)
    with torch.cuda.stream(comm):
        flat.record_stream(comm)
        return quantize_shard(flat, layout, qdtype)


def dequantize_gathered_impl(gathered: torch.Tensor, unit: str, full_shapes, world_size: int, qdtype, block: int,
                             dtype):
    layout = quantized_layout(full_shapes, world_size, block)
    return dequantize_gathered(gathered, layout, world_size, to_torch_dtype(qdtype), to_torch_dtype(dtype))


for _prim, _name, _impl in (
    (qg.quantize_shard, QUANTIZE_SHARD_OP, quantize_shard_impl),
    (qg.dequantize_gathered, DEQUANTIZE_GATHERED_OP, dequantize_gathered_impl),
):
    comm_ex.register_implementation(_prim, comm_ex.register_operator(_name, meta=_prim.meta, fn=_impl))
