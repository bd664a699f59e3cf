"""How a unit's quantized shard lies in the one uint8 buffer its all-gather moves: ``MixedPrecision(gather_dtype=...)``.

Pure arithmetic on sizes (no tensors), shared by the ops that pack and unpack the buffer
(:mod:`fsdp_pass.ops.quantize`), the byte counts of ``explain()`` and of the planner, and the labels.

1. Each parameter's part of this rank's packed shard (``shard_numel`` elements, its padding rows included) is
   cut into blocks of ``block`` consecutive elements, the last one shorter; a block never spans two
   parameters. Each block has one float32 scale: ``amax(|x|) / qmax`` (``qmax``: 127 for int8, 448 for
   float8_e4m3fn), so its largest element lands on the largest code and every other one is rounded relative
   to it.
2. Why blocks of elements, for both dtypes: a per-tensor scale is what float8 needs at the least, but one
   outlier (a norm weight of 1.0 beside linear weights of 0.02) then costs every other element of the tensor
   its precision; int8 has a uniform grid and no exponent, so its error is relative to the block's largest
   element and it needs small blocks (ZeRO++'s qwZ quantizes blocks for that reason). Per row of the
   parameter does not work for the layout's 1-D parameters, whose rows are single elements (a scale per
   element). Blocks of the flat shard are independent of shapes, cost 4 bytes per ``block`` elements (128:
   3 %), and a short last block per parameter is the only waste.
3. This rank's part of the buffer: the scales first (float32, ``4 * blocks`` bytes, so they are 4-byte
   aligned in every rank's part of the gathered buffer and read back as a float32 view), then the quantized
   elements (one byte each, in the packed shard's order), then zero bytes up to a multiple of 4 (so the
   next rank's scales are aligned too). The all-gather places every rank's part side by side: one collective
   per unit, scales included.
4. The kernels (:mod:`fsdp_pass.ops.quantize`) work through a parameter a chunk of whole blocks at a time
   (:func:`chunk_elements`: 2^16 elements on the CPU, 2^22 on a GPU, where each chunk costs a few kernel launches),
   through one float32 scratch buffer per op: quantizing always (the codes are rounded from float32 values), and
   dequantizing on the CPU only, into a compute dtype other than float32 (the CPU's mixed-dtype kernels would copy
   whole operands to float32). :func:`quantize_scratch_bytes` and :func:`dequantize_scratch_numel` (float32
   elements) are what the op holds beside its output while it runs: the memory model counts them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from fsdp_pass.plan.layout import ShardLayout

# the gather dtypes MixedPrecision accepts, with the largest code a block's largest element is scaled to
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_DTYPE = torch.float32
SCALE_BYTES = 4
DEFAULT_BLOCK = 128
# elements of a chunk the kernels work through at a time (item 4), by device type (the meta device of a dry run
# counts as the CPU)
CHUNK_ELEMENTS = {"cuda": 1 << 22, "cpu": 1 << 16}


def _blocks(numel: int, block: int) -> int:
    return -(-numel // block)


@dataclass(frozen=True)
class QuantizedLayout:
    """One rank's part of a unit's quantized gather buffer (item 3 of the module docstring)."""

    shard_numels: tuple[int, ...]  # each parameter's elements in one rank's packed shard
    block: int

    @property
    def blocks(self) -> tuple[int, ...]:
        """Each parameter's number of blocks (its last one may be short)."""
        return tuple(_blocks(n, self.block) for n in self.shard_numels)

    @property
    def n_blocks(self) -> int:
        return sum(self.blocks)

    @property
    def rank_numel(self) -> int:
        return sum(self.shard_numels)

    @property
    def scale_bytes(self) -> int:
        return SCALE_BYTES * self.n_blocks

    @property
    def rank_bytes(self) -> int:
        """Bytes of one rank's part: scales, one byte per element, zeros up to a multiple of 4."""
        return -(-(self.scale_bytes + self.rank_numel) // SCALE_BYTES) * SCALE_BYTES


@lru_cache(maxsize=4096)
def quantized_layout(full_shapes: tuple, world_size: int, block: int) -> QuantizedLayout:
    """The layout of a unit whose parameters have ``full_shapes``, at ``world_size`` (worked out once per unit)."""
    return QuantizedLayout(tuple(ShardLayout(tuple(s), world_size).shard_numel for s in full_shapes), block)


def quantized_nbytes(layout: ShardLayout, block: int) -> int:
    """A whole parameter's bytes as the quantized gathers move it: every rank's elements (one byte each, the
    padding rows' too) and their scales (the 0 to 3 bytes of alignment per unit left out)."""
    return layout.world_size * (layout.shard_numel + SCALE_BYTES * _blocks(layout.shard_numel, block))


def chunk_elements(block: int, device_type: str) -> int:
    """Elements of the chunks a kernel works through on ``device_type`` (item 4): whole blocks, at least one."""
    chunk = CHUNK_ELEMENTS["cuda" if device_type == "cuda" else "cpu"]
    return max(1, chunk // block) * block


def quantize_scratch(layout: QuantizedLayout, device_type: str) -> tuple[int, int]:
    """(float32 elements, blocks) of the scratch quantizing one rank's shards takes on ``device_type``: a chunk of the
    largest shard, at most, and two floats per block of it (each block's smallest and largest element)."""
    numel = min(chunk_elements(layout.block, device_type), max(layout.shard_numels, default=0))
    return numel, max(1, numel // layout.block)


def quantize_scratch_bytes(layout: QuantizedLayout, device_type: str) -> int:
    """Bytes quantizing holds beside its output while it runs (item 4): the float32 chunk, its blocks' bounds, and
    one byte per block (which of them are all zeros)."""
    numel, blocks = quantize_scratch(layout, device_type)
    return 4 * numel + 9 * blocks


def dequantize_chunk(layout: QuantizedLayout, world_size: int, device_type: str) -> int:
    """Elements of one rank's part of a parameter that dequantizing takes at a time (every rank's at once)."""
    return max(1, chunk_elements(layout.block, device_type) // (layout.block * world_size)) * layout.block


def dequantize_scratch_numel(layout: QuantizedLayout, world_size: int, dtype: torch.dtype, device_type: str) -> int:
    """Float32 elements of the scratch dequantizing into ``dtype`` takes on ``device_type`` (item 4): none on a GPU or
    into float32, else a chunk of every rank's part of the largest parameter, at most."""
    if device_type == "cuda" or dtype == torch.float32:
        return 0
    return world_size * min(dequantize_chunk(layout, world_size, device_type), max(layout.shard_numels, default=0))
