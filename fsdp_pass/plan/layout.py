"""How one parameter is cut into shards: dim 0, padded so every rank holds the same number of rows.

A parameter of shape ``(R, *rest)`` at world size ``N`` is padded with zero rows to
``ceil(R / N) * N`` rows; rank ``r`` holds rows ``[r * k, (r + 1) * k)`` with ``k = ceil(R / N)``.
A 0-d parameter is treated as shape ``(1,)``. Padding rows are zero and stay zero: their gradient is
zero, so element-wise optimizers never move them, and they are dropped whenever the parameter is
gathered.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch


@dataclass(frozen=True)
class ShardLayout:
    """The dim-0 shard layout of one parameter at one world size."""

    shape: tuple[int, ...]  # the full (unsharded) shape
    world_size: int

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_numel(self) -> int:
        return prod(self.shape[1:]) if self.shape else 1

    @property
    def rows_per_rank(self) -> int:
        return -(-self.rows // self.world_size)

    @property
    def padded_rows(self) -> int:
        return self.rows_per_rank * self.world_size

    @property
    def padding_rows(self) -> int:
        return self.padded_rows - self.rows

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return (self.rows_per_rank, *self.shape[1:])

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def shard_numel(self) -> int:
        return self.rows_per_rank * self.row_numel

    @property
    def padding_numel(self) -> int:
        return self.padding_rows * self.row_numel

    def rows_on(self, rank: int) -> int:
        """How many of rank ``rank``'s rows are real (not padding): ``torch.chunk``'s cut of the rows, so a
        DTensor ``Shard(0)`` of the full shape has exactly these rows on each rank."""
        return max(0, min(self.rows, (rank + 1) * self.rows_per_rank) - rank * self.rows_per_rank)


def shard_tensor(full: torch.Tensor, layout: ShardLayout, rank: int) -> torch.Tensor:
    """Return rank ``rank``'s shard of ``full`` (a new tensor, zero padded)."""
    rows = full.reshape(layout.rows, layout.row_numel) if full.dim() == 0 else full
    start = rank * layout.rows_per_rank
    stop = min(start + layout.rows_per_rank, layout.rows)
    shard = torch.zeros(layout.shard_shape, dtype=full.dtype, device=full.device)
    if stop > start:
        shard[: stop - start].copy_(rows[start:stop].reshape(stop - start, *layout.shape[1:]))
    return shard


def unpad_gathered(gathered: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """Turn the rank-major concatenation of all shards back into the full parameter."""
    return gathered.reshape(layout.padded_rows, *layout.shape[1:])[: layout.rows].reshape(layout.shape)
