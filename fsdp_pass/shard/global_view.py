"""One rank's shard seen as the whole parameter: as a DTensor (no copy, what a checkpoint saves) or
gathered into the full tensor (one all-gather), and back into a shard from either.

A ``(R, *rest)`` parameter at world size ``N`` is cut into ``k = ceil(R / N)`` rows per rank, zero-padded
(:mod:`fsdp_pass.plan.layout`). ``torch.chunk`` cuts the rows the same way, so the real rows of rank
``r``'s shard (``layout.rows_on(r)``, possibly none) are exactly the local tensor of a DTensor with
placement ``Shard(0)`` on the 1-D mesh of the FSDP group. ``torch.distributed.checkpoint`` writes each
rank's rows once and reads them back at any world size.

- :func:`as_dtensor`: a shard (or an optimizer state shaped like one) as that DTensor; a view, so loading a
  checkpoint into it writes into the shard. A 0-d parameter has no dim 0 to cut: it is saved whole
  (:func:`gather_full`), a plain tensor every rank holds.
- :func:`gather_full`: the full tensor, padding dropped (collective).
- :func:`shard_of`: this rank's padded shard (a new tensor) of a full tensor or of a DTensor.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from fsdp_pass.plan.layout import ShardLayout, shard_tensor, unpad_gathered


@functools.cache
def mesh_of(group, device_type: str) -> DeviceMesh:
    """The 1-D DeviceMesh over the FSDP group, for tensors on ``device_type`` (a mesh moves local tensors
    to its own device type, so offloaded shards get a CPU mesh)."""
    return DeviceMesh.from_group(group, device_type)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def as_dtensor(shard: torch.Tensor, layout: ShardLayout, group) -> DTensor:
    """The DTensor ``Shard(0)`` of global shape ``layout.shape`` whose local tensor is this rank's real rows
    of ``shard`` (a view: nothing is copied, and nothing is asked of other ranks)."""
    rows = shard.detach()[: layout.rows_on(dist.get_rank(group))]
    mesh = mesh_of(group, shard.device.type)
    return DTensor.from_local(
        rows, mesh, [Shard(0)], run_check=False, shape=torch.Size(layout.shape), stride=_contiguous_stride(layout.shape)
    )


def gather_full(shard: torch.Tensor, layout: ShardLayout, group) -> torch.Tensor:
    """All-gather one dim-0 shard and drop the padding."""
    out = torch.empty((layout.padded_rows, *layout.shape[1:]), dtype=shard.dtype, device=shard.device)
    dist.all_gather_into_tensor(out, shard.detach().contiguous(), group=group)
    return unpad_gathered(out, layout)


def is_our_cut(value: DTensor, layout: ShardLayout, group) -> bool:
    """Whether ``value``'s local tensor is this rank's real rows in our layout (a DTensor of this group's
    mesh, ``Shard(0)``), so it can be copied in without asking other ranks."""
    mesh = value.device_mesh
    return (
        tuple(value.placements) == (Shard(0),)
        and mesh.ndim == 1
        and mesh.size() == layout.world_size
        and mesh.get_group().group_name == group.group_name
        and tuple(value.shape) == layout.shape
    )


def shard_of(value: torch.Tensor, layout: ShardLayout, rank: int, group, like: torch.Tensor) -> torch.Tensor:
    """This rank's padded shard of ``value`` (a full tensor, or a DTensor of the full shape), as a new tensor
    with ``like``'s dtype and device. A DTensor in another cut is gathered first (collective)."""
    if isinstance(value, DTensor):
        if is_our_cut(value, layout, group):
            out = torch.zeros(layout.shard_shape, dtype=like.dtype, device=like.device)
            out[: layout.rows_on(rank)].copy_(value.to_local())
            return out
        value = value.full_tensor()
    return shard_tensor(value.to(like.device, like.dtype), layout, rank)
