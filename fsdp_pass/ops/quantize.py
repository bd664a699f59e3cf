"""The torch math of a quantized parameter gather: this rank's shards into its part of one uint8 buffer of codes and
scales, and the gathered buffer back to the compute dtype (the layout: :mod:`fsdp_pass.plan.quantized_layout`).

``quantize_shards(shards, layout, qdtype, out)``: this rank's part of the gather, written into ``out`` (its slice of
the gathered buffer, ``layout.rank_bytes`` uint8):

1. Each parameter's shard (its padding rows included, zeros) is cut into blocks of ``layout.block`` elements, the
   last one shorter; per block, in float32: ``scale = amax(|x|) / qmax`` (0 for an all-zero block).
2. The codes: ``x / scale`` (an all-zero block divides by 1), rounded half to even and clamped to ``[-127, 127]``
   for int8; clamped to ``[-448, 448]`` and rounded by the cast for float8_e4m3fn.
3. Scales first (float32 bytes), codes after, zero bytes to a multiple of 4.

``dequantize_gathered(gathered, layout, world_size, qdtype, dtype) -> flat buffer`` (every rank's part, side by side):

1. Each rank's scales read back as a float32 view of its part, its codes as a view in ``qdtype``.
2. Per parameter: ``code * scale`` in float32, rounded once to ``dtype`` (the compute dtype) and written straight
   into the output, rank-major (all of rank 0's elements, then rank 1's, ...): the layout that
   :func:`~fsdp_pass.ops.flat_buffers.unpack_gathered` cuts the parameters out of.

How the work is done (item 4 of the layout): a chunk of whole blocks at a time, so no temporary is as large as a
parameter or a shard. Quantizing reads each chunk where the shard lives (a float32 shard on the device as it is;
another dtype, or an offloaded shard, copied into the float32 scratch first: host to device in float32, a chunk at a
time), takes each block's bounds with ``aminmax`` (no ``|x|`` copy), divides into the scratch, rounds and clamps
there and casts into the codes. Dequantizing on a GPU takes no scratch: int8 codes in one ``mul(codes, scales,
out=...)`` (the kernel casts as it loads and stores), float8 codes (torch promotes no float8 operand) copied into the
output, exactly (every int8 and float8_e4m3fn code is a float32, bfloat16 and float16 number), and multiplied by
their scales in place; on the CPU, whose mixed-dtype kernels copy whole operands to float32 first, the same copy and
multiplication in a float32 scratch chunk, then cast into the output (straight into a float32 output).

A NaN or inf in a block makes its scale, and so the block, non-finite: the gathered parameters stay non-finite,
as in an unquantized gather (``check_finite`` reads the shards the op quantizes).

Every step is elementwise or a max, so the result does not depend on how the work is split: a reference that
quantizes each rank's shard of each parameter on its own, whole (``tests/quantized_cases.py``), gets the same bits.
"""

from __future__ import annotations

import torch

from fsdp_pass.plan.quantized_layout import (
    QMAX,
    SCALE_DTYPE,
    QuantizedLayout,
    chunk_elements,
    dequantize_chunk,
    dequantize_scratch_numel,
    quantize_scratch,
)


def _runs(n: int, chunk: int, block: int):
    """(start, rows, width) of the 2-D pieces of ``n`` elements, a ``chunk`` at a time: whole blocks of ``block``
    elements, then the short last block."""
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        full = (stop - start) // block
        if full:
            yield start, full, block
        if start + full * block < stop:
            yield start + full * block, 1, stop - start - full * block


def _quantize_rows(x, codes, scales, qdtype, work, bounds) -> None:
    """Steps 1-2 for ``x`` (blocks as rows, any floating dtype and device) into ``codes`` and ``scales`` (their
    views of the buffer), through ``work`` (float32, ``x``'s shape) and ``bounds`` (float32, two rows)."""
    if x.dtype != torch.float32 or x.device != work.device:
        work.copy_(x, non_blocking=True)  # a cast, or a chunk of an offloaded shard crossing to the device
        x = work
    low, high = bounds[0], bounds[1]
    torch.aminmax(x, dim=1, out=(low, high))
    # amax(|x|): a NaN in the block is in both bounds (fmax keeps its bits, as amax does; maximum makes a new NaN)
    torch.fmax(low.abs_(), high.abs_(), out=high)
    torch.div(high, QMAX[qdtype], out=scales)
    torch.where(scales > 0, scales, high.fill_(1.0), out=high)  # an all-zero block divides by 1
    torch.div(x, high[:, None], out=work)
    qmax = QMAX[qdtype]
    if qdtype == torch.int8:
        work.round_()
    codes.copy_(work.clamp_(-qmax, qmax))


def quantize_shards(shards, layout: QuantizedLayout, qdtype: torch.dtype, out: torch.Tensor) -> torch.Tensor:
    """This rank's shards (``layout.shard_numels`` elements each, any floating dtype, on ``out``'s device or
    offloaded) -> ``out`` (``layout.rank_bytes`` uint8), its part of the gather buffer, which it returns."""
    end = layout.scale_bytes + layout.rank_numel
    out[end:].zero_()  # the alignment bytes: the same on every run
    scales = out[: layout.scale_bytes].view(SCALE_DTYPE)
    codes = out[layout.scale_bytes : end].view(qdtype)
    numel, blocks = quantize_scratch(layout, out.device.type)
    work = torch.empty(numel, dtype=torch.float32, device=out.device)
    bounds = torch.empty(2, blocks, dtype=torch.float32, device=out.device)
    chunk, b = chunk_elements(layout.block, out.device.type), layout.block
    offset, first_block = 0, 0
    for shard, n, nb in zip(shards, layout.shard_numels, layout.blocks):
        flat = shard.reshape(-1)
        for start, rows, width in _runs(n, chunk, b):
            at, size = offset + start, rows * width
            block = first_block + start // b
            _quantize_rows(flat[start : start + size].view(rows, width), codes[at : at + size].view(rows, width),
                           scales[block : block + rows], qdtype, work[:size].view(rows, width), bounds[:, :rows])
        offset, first_block = offset + n, first_block + nb
    return out


def _dequantize_rows(codes, scales, out, work, fused_casts: bool) -> None:
    """Step 2 for ``codes`` (ranks x blocks x elements) times ``scales`` (ranks x blocks x 1) into ``out``."""
    if work is not None:  # the CPU into a narrower dtype: float32 in the scratch, then one cast
        work = work[: codes.numel()].view(codes.shape)
        work.copy_(codes)
        out.copy_(work.mul_(scales))
    elif fused_casts and codes.dtype == torch.int8:
        torch.mul(codes, scales, out=out)
    else:  # the codes are exact in the output's dtype; the product is rounded once, from float32
        out.copy_(codes)
        out.mul_(scales)


def dequantize_gathered(
    gathered: torch.Tensor, layout: QuantizedLayout, world_size: int, qdtype: torch.dtype, dtype: torch.dtype,
    device_type: str | None = None,
) -> torch.Tensor:
    """The gathered buffer (``world_size * layout.rank_bytes`` uint8) -> every rank's packed shard in ``dtype``,
    rank-major (``world_size * layout.rank_numel`` elements). ``device_type``: whose kernels to use (None: the
    buffer's device's; the tests run the GPU's on the CPU)."""
    device_type = device_type or gathered.device.type
    parts = gathered.view(world_size, layout.rank_bytes)
    scales = parts[:, : layout.scale_bytes].view(SCALE_DTYPE)  # (world, blocks): a view, the parts are 4-aligned
    codes = parts[:, layout.scale_bytes : layout.scale_bytes + layout.rank_numel].view(qdtype)
    out = torch.empty(world_size, layout.rank_numel, dtype=dtype, device=gathered.device)
    scratch = dequantize_scratch_numel(layout, world_size, dtype, device_type)
    work = torch.empty(scratch, dtype=torch.float32, device=gathered.device) if scratch else None
    chunk, b = dequantize_chunk(layout, world_size, device_type), layout.block
    offset, first_block = 0, 0
    for n, nb in zip(layout.shard_numels, layout.blocks):
        for start, rows, width in _runs(n, chunk, b):
            columns, block = slice(offset + start, offset + start + rows * width), first_block + start // b
            _dequantize_rows(codes[:, columns].view(world_size, rows, width),
                             scales[:, block : block + rows, None], out[:, columns].view(world_size, rows, width),
                             work, device_type == "cuda")
        offset, first_block = offset + n, first_block + nb
    return out.view(-1)
