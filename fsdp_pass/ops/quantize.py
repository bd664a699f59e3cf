"""The torch math of a quantized parameter gather: a packed shard to one uint8 buffer of codes and scales, and
the gathered buffer back to the compute dtype (the layout: :mod:`fsdp_pass.plan.quantized_layout`).

``quantize_shard(flat, layout, qdtype) -> uint8 buffer`` (this rank's part of the gather):

1. For each parameter's part of the packed shard (its padding rows included, zeros), cut into blocks of
   ``layout.block`` elements (the last one padded with zeros here, not in the buffer), in float32:
   ``scale = amax(|x|) / qmax`` per block (0 for an all-zero block).
2. The codes: ``x / scale`` (an all-zero block divides by 1), rounded half to even and clamped to
   ``[-127, 127]`` for int8; clamped to ``[-448, 448]`` and rounded by the cast for float8_e4m3fn.
3. Scales first (float32 bytes), codes after, zero bytes to a multiple of 4.

``dequantize_gathered(gathered, layout, world_size, qdtype, dtype) -> flat buffer`` (every rank's part, side by side):

1. Each rank's scales read back as a float32 view of its part, its codes as a view in ``qdtype``.
2. Per parameter: ``codes.float() * scale`` of their block, in float32, then cast to ``dtype`` (the compute
   dtype); written rank-major (all of rank 0's elements, then rank 1's, ...), the layout that
   :func:`~fsdp_pass.ops.flat_buffers.unpack_gathered` cuts the parameters out of.

A NaN or inf in a block makes its scale, and so the block, non-finite: the gathered parameters stay non-finite,
as in an unquantized gather (``check_finite`` reads the shard before it is quantized).

Every step is elementwise or a max, so the result does not depend on how the work is split: a reference that
quantizes each rank's shard of each parameter on its own (``tests/quantized_cases.py``) gets the same bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fsdp_pass.plan.quantized_layout import QMAX, SCALE_DTYPE, QuantizedLayout


def block_scales(blocks: torch.Tensor, qdtype: torch.dtype) -> torch.Tensor:
    """Step 1: one float32 scale per row of ``blocks`` (float32, ``(n_blocks, block)``)."""
    return blocks.abs().amax(dim=1) / QMAX[qdtype]


def to_codes(x: torch.Tensor, scales: torch.Tensor, qdtype: torch.dtype) -> torch.Tensor:
    """Step 2: ``x`` (float32, ``(n_blocks, block)``) divided by its rows' scales, as ``qdtype`` codes."""
    scaled = x / torch.where(scales > 0, scales, torch.ones_like(scales))[:, None]
    qmax = QMAX[qdtype]
    if qdtype == torch.int8:
        return scaled.round_().clamp_(-qmax, qmax).to(torch.int8)
    return scaled.clamp_(-qmax, qmax).to(qdtype)


def quantize_shard(flat: torch.Tensor, layout: QuantizedLayout, qdtype: torch.dtype) -> torch.Tensor:
    """This rank's packed shard ``flat`` (``layout.rank_numel`` elements, any floating dtype) -> its part of the
    gather buffer (``layout.rank_bytes`` uint8)."""
    out = torch.empty(layout.rank_bytes, dtype=torch.uint8, device=flat.device)
    end = layout.scale_bytes + layout.rank_numel
    out[end:].zero_()  # the alignment bytes: the same on every run
    scales = out[: layout.scale_bytes].view(SCALE_DTYPE)
    codes = out[layout.scale_bytes : end].view(qdtype)
    offset, first_block, b = 0, 0, layout.block
    for n, nb in zip(layout.shard_numels, layout.blocks):
        blocks = F.pad(flat[offset : offset + n].to(torch.float32), (0, nb * b - n)).view(nb, b)
        s = block_scales(blocks, qdtype)
        scales[first_block : first_block + nb] = s
        codes[offset : offset + n] = to_codes(blocks, s, qdtype).view(-1)[:n]
        offset, first_block = offset + n, first_block + nb
    return out


def dequantize_gathered(
    gathered: torch.Tensor, layout: QuantizedLayout, world_size: int, qdtype: torch.dtype, dtype: torch.dtype
) -> torch.Tensor:
    """The gathered buffer (``world_size * layout.rank_bytes`` uint8) -> every rank's packed shard in ``dtype``,
    rank-major (``world_size * layout.rank_numel`` elements)."""
    parts = gathered.view(world_size, layout.rank_bytes)
    scales = parts[:, : layout.scale_bytes].view(SCALE_DTYPE)  # (world, blocks): a view, the parts are 4-aligned
    codes = parts[:, layout.scale_bytes : layout.scale_bytes + layout.rank_numel].view(qdtype)
    out = torch.empty(world_size, layout.rank_numel, dtype=dtype, device=gathered.device)
    offset, first_block, b = 0, 0, layout.block
    for n, nb in zip(layout.shard_numels, layout.blocks):
        full = n // b  # whole blocks, then the short last one
        if full:
            whole = slice(offset, offset + full * b)
            values = codes[:, whole].view(world_size, full, b).to(torch.float32)
            values.mul_(scales[:, first_block : first_block + full, None])
            out[:, whole].view(world_size, full, b).copy_(values)
        if n > full * b:
            last = first_block + full
            values = codes[:, offset + full * b : offset + n].to(torch.float32).mul_(scales[:, last : last + 1])
            out[:, offset + full * b : offset + n].copy_(values)
        offset, first_block = offset + n, first_block + nb
    return out.view(-1)
