"""A unit's all-gather in 8 bits: ``MixedPrecision(gather_dtype=torch.int8 | torch.float8_e4m3fn)``.

``gather_quantized(shards, group, unit, full_shapes, param_dtype, compute_device, gather_dtype, block)``: what
:func:`fsdp_pass.ops.unshard.unshard_unit` decomposes into when its unit is gathered quantized; readable in the
printed trace, one collective per unit as without quantization:

1. ``pack_shards``: this rank's shards in one flat buffer, in their own dtype (float32 master weights, not cast:
   quantizing from them loses less than quantizing a bfloat16 copy), copied to the compute device (offload);
2. ``quantize_shard``: that buffer as one uint8 buffer of float32 block scales and 8-bit codes
   (:mod:`fsdp_pass.plan.quantized_layout`, :mod:`fsdp_pass.ops.quantize`);
3. ``all_gather`` of the uint8 buffer (async) and its ``wait``: codes and scales in the same collective;
4. ``dequantize_gathered``: the gathered codes times their scales, in the compute dtype (``param_dtype``, else
   the shards' dtype), laid out rank-major like an unquantized gathered buffer;
5. ``unpack_gathered``: the parameters cut out of it, padding rows dropped (the op of the unquantized gather).

The gradient rule of ``unshard_unit`` is unchanged: the gradients of the gathered (dequantized) parameters are
reduce-scattered in ``reduce_dtype`` and land on the float32 shards as they come, the straight-through gradient
of the rounding (the optimizer steps the master weights; only the gather is quantized).

Both new ops are claimed by ``fsdp_comm`` (:mod:`fsdp_pass_executors.quantized_buffers`), so no fusion executor
takes them into a compute region; like the other pack and unpack ops, their second argument is the unit's name.
"""

from __future__ import annotations

from thunder.core import dtypes, prims
from thunder.core.proxies import TensorProxy
from thunder.distributed import prims as dist_prims

from fsdp_pass.errors import check
from fsdp_pass.op_names import DEQUANTIZE_GATHERED, QUANTIZE_SHARD
from fsdp_pass.ops.flat_buffers import pack_shards, unpack_gathered
from fsdp_pass.plan.quantized_layout import quantized_layout


def _quantize_shard_meta(flat, unit: str, full_shapes, world_size: int, qdtype, block: int) -> TensorProxy:
    layout = quantized_layout(full_shapes, world_size, block)
    return TensorProxy(like=flat, shape=(layout.rank_bytes,), dtype=dtypes.uint8)


def _dequantize_gathered_meta(gathered, unit: str, full_shapes, world_size: int, qdtype, block: int, dtype):
    layout = quantized_layout(full_shapes, world_size, block)
    return TensorProxy(like=gathered, shape=(world_size * layout.rank_numel,), dtype=dtype)


quantize_shard = prims.make_prim(QUANTIZE_SHARD, "quantize_shard", meta=_quantize_shard_meta)
dequantize_gathered = prims.make_prim(DEQUANTIZE_GATHERED, "dequantize_gathered", meta=_dequantize_gathered_meta)


def gather_quantized(shards, group, unit: str, full_shapes: tuple, param_dtype, compute_device, gather_dtype, block):
    """Steps 1-5: the unit's full parameters in ``param_dtype`` (None: the shards' dtype) from every rank's
    shards, gathered as ``gather_dtype`` codes with a float32 scale per ``block`` elements."""
    check(
        all(dtypes.is_float_dtype(s.dtype) for s in shards),
        f"Unit {unit!r} has a parameter that is not floating point ({', '.join(str(s.dtype) for s in shards)}): "
        "a quantized gather quantizes floating-point parameters only.",
        "Register integer tensors as buffers rather than parameters, or gather unquantized (gather_dtype=None).",
    )
    world_size = group.size()
    flat = pack_shards(shards, unit, None, compute_device)
    codes = quantize_shard(flat, unit, full_shapes, world_size, gather_dtype, block)
    gathered = dist_prims.wait(dist_prims.all_gather(codes, group, True, None))
    values = dequantize_gathered(gathered, unit, full_shapes, world_size, gather_dtype, block,
                                 param_dtype or shards[0].dtype)
    return unpack_gathered(values, unit, full_shapes, world_size)
