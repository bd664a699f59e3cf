"""A unit's all-gather in 8 bits: ``MixedPrecision(gather_dtype=torch.int8 | torch.float8_e4m3fn)``.

``gather_quantized(shards, group, unit, full_shapes, param_dtype, compute_device, gather_dtype, block)``: what
:func:`fsdp_pass.ops.unshard.unshard_unit` decomposes into when its unit is gathered quantized; readable in the
printed trace, one collective per unit as without quantization:

1. ``quantize_shard``: this rank's shards, as they are stored (float32 master weights, not cast: quantizing from
   them loses less than quantizing a bfloat16 copy; offloaded ones copied to the compute device a chunk at a time),
   quantized into float32 block scales and 8-bit codes (:mod:`fsdp_pass.plan.quantized_layout`,
   :mod:`fsdp_pass.ops.quantize`), written into this rank's slice of the uint8 gathered buffer, which the op
   allocates whole, as ``pack_shards`` does for an unquantized gather: no packed copy of the shards, no send buffer;
2. ``all_gather`` of that slice (async), which fills the gathered buffer in place around it, and its ``wait``: codes
   and scales in the same collective;
3. ``dequantize_gathered``: the gathered codes times their scales, straight into a buffer in the compute dtype
   (``param_dtype``, else the shards' dtype), laid out rank-major like an unquantized gathered buffer;
4. ``unpack_gathered``: the parameters cut out of it, padding rows dropped (the op of the unquantized gather).

What a unit holds: the gathered uint8 buffer (codes and scales of every rank: what the gather sends, about 1.03 B an
element) from the quantize until the dequantize has read it, the dequantized buffer (2 or 4 B an element: what it
computes with) from then on, and, while each op runs, its float32 scratch chunk (:func:`scratch_bytes`). The step
model and ``explain()`` count the bytes sent and the bytes held apart (:meth:`MixedPrecision.sent_nbytes`,
:meth:`MixedPrecision.held_nbytes`).

The gradient rule of ``unshard_unit`` is unchanged: the gradients of the gathered (dequantized) parameters are
reduce-scattered in ``reduce_dtype`` and land on the float32 shards as they come, the straight-through gradient
of the rounding (the optimizer steps the master weights; only the gather is quantized).

Both new ops are claimed by ``fsdp_comm`` (:mod:`fsdp_pass_executors.quantized_buffers`), so no fusion executor
takes them into a compute region; like the other pack and unpack ops, their second argument is the unit's name, and
their fourth the shard group's size.
"""

from __future__ import annotations

from thunder.core import devices, dtypes, prims
from thunder.core.proxies import TensorProxy
from thunder.distributed import prims as dist_prims

from fsdp_pass.errors import check
from fsdp_pass.op_names import DEQUANTIZE_GATHERED, QUANTIZE_SHARD
from fsdp_pass.ops.flat_buffers import unpack_gathered
from fsdp_pass.plan.quantized_layout import dequantize_scratch_numel, quantize_scratch_bytes, quantized_layout
from fsdp_pass.predicates import is_dequantize_gathered, is_quantize_shard


def _quantize_shard_meta(shards, unit: str, full_shapes, world_size: int, qdtype, block: int, device, group):
    layout = quantized_layout(full_shapes, world_size, block)
    device = shards[0].device if device is None else devices.to_device(device)
    return TensorProxy(like=shards[0], shape=(layout.rank_bytes,), dtype=dtypes.uint8, device=device)


def _dequantize_gathered_meta(gathered, unit: str, full_shapes, world_size: int, qdtype, block: int, dtype):
    layout = quantized_layout(full_shapes, world_size, block)
    return TensorProxy(like=gathered, shape=(world_size * layout.rank_numel,), dtype=dtype)


quantize_shard = prims.make_prim(QUANTIZE_SHARD, "quantize_shard", meta=_quantize_shard_meta)
dequantize_gathered = prims.make_prim(DEQUANTIZE_GATHERED, "dequantize_gathered", meta=_dequantize_gathered_meta)


def gather_quantized(shards, group, unit: str, full_shapes: tuple, param_dtype, compute_device, gather_dtype, block):
    """Steps 1-4: the unit's full parameters in ``param_dtype`` (None: the shards' dtype) from every rank's
    shards, gathered as ``gather_dtype`` codes with a float32 scale per ``block`` elements."""
    check(
        all(dtypes.is_float_dtype(s.dtype) for s in shards),
        f"Unit {unit!r} has a parameter that is not floating point ({', '.join(str(s.dtype) for s in shards)}): "
        "a quantized gather quantizes floating-point parameters only.",
        "Register integer tensors as buffers rather than parameters, or gather unquantized (gather_dtype=None).",
    )
    world_size = group.size()
    codes = quantize_shard(shards, unit, full_shapes, world_size, gather_dtype, block, compute_device, group)
    gathered = dist_prims.wait(dist_prims.all_gather(codes, group, True, None))
    values = dequantize_gathered(gathered, unit, full_shapes, world_size, gather_dtype, block,
                                 param_dtype or shards[0].dtype)
    return unpack_gathered(values, unit, full_shapes, world_size)


def quantized_gather_bytes(bsym) -> int:
    """Bytes of the buffer a quantize op allocates: the whole gathered buffer (step 1), whose slice it returns."""
    return int(bsym.output.numel) * bsym.args[3]


def scratch_bytes(bsym) -> int:
    """Bytes a quantize or dequantize op holds beside its output while it runs (its float32 scratch, on the device its
    output lives on: :mod:`fsdp_pass.plan.quantized_layout`, item 4); 0 for any other op."""
    if is_quantize_shard(bsym):
        _, _, shapes, world, _, block, _, _ = bsym.args
        return quantize_scratch_bytes(quantized_layout(shapes, world, block), bsym.output.device.type)
    if is_dequantize_gathered(bsym):
        _, _, shapes, world, _, block, dtype = bsym.args
        layout = quantized_layout(shapes, world, block)
        return 4 * dequantize_scratch_numel(layout, world, dtypes.to_torch_dtype(dtype), bsym.output.device.type)
    return 0
