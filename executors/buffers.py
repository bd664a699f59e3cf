"""The ``fsdp_comm`` executor's torch code for the ops around a unit's collectives (:mod:`fsdp_pass.ops.flat_buffers`).

In a printed execution trace they read ``fsdp_pack_shards``, ``fsdp_unpack_gathered``, ``fsdp_pack_grads`` and
``fsdp_unpack_grad_shard``. Being this executor's ops, no fusion executor takes them into a fusion region.

- Packing copies each shard into its slice of one flat buffer, casting on the way (one pass, no second
  copy for mixed precision). That flat buffer is this rank's slice of the whole gathered buffer, which
  packing allocates (on the compute stream) and hands on as the slice's ``GATHERED_BUFFER`` attribute; the
  all-gather (:mod:`fsdp_pass_executors.collectives`) fills it in place around the slice, so no send buffer
  lives beside the gathered one. Shards offloaded to pinned host memory are copied to the GPU on the
  communication stream, after it waits for the compute stream, so the copy runs while the compute stream
  goes on and the all-gather that reads the buffer follows it on the same stream. The buffer names that stream
  (:data:`fsdp_pass.ops.flat_buffers.WRITTEN_ON`): ``check_finite=True``'s check of the packed shard, which reads it
  before the all-gather's wait, runs on it too, after the copy (the quantized gather's pack is this op as well).
- Unpacking a gathered buffer copies each parameter out of the rank-major layout with one
  ``split_with_sizes_copy`` (one kernel on CUDA); padding rows are dropped as a view of a prefix. Only a
  one-parameter unit copies nothing (its parameter is a view of the buffer); a unit of several parameters is
  copied out at every world size, world size 1 included (:func:`fsdp_pass.ops.flat_buffers.unpack_is_view`).
- Over one rank a unit's gather is ``fsdp_view_shards``: each shard viewed in its parameter's shape.
- Packing gradients lays each out as (world size, shard elements) column blocks of one buffer in the reduce
  dtype: one ``cat`` into it (casting on the way) when no parameter has padding rows, else a copy per
  parameter with its padding rows zeroed. Unpacking the reduced shard divides it in place (by the number of
  ranks whose gradients were summed), casts it to the
  shards' dtype, copies it to where the shards live (a blocking copy: the optimizer reads it on the host
  next), and cuts the shard gradients out of it as views.
- The layout arithmetic of a unit is worked out once (:func:`fsdp_pass.ops.flat_buffers.unit_buffer`), not on
  every step.
"""

from __future__ import annotations

from math import prod

import torch
from fsdp_pass_executors.collectives import GATHERED_BUFFER, comm_ex, communication_stream
from thunder.core.dtypes import to_torch_dtype

from fsdp_pass.op_names import PACK_GRADS_OP, PACK_SHARDS_OP, UNPACK_GATHERED_OP, UNPACK_GRAD_SHARD_OP, VIEW_SHARDS_OP
from fsdp_pass.ops import flat_buffers as fb


def _torch_dtype(dtype):
    return None if dtype is None else to_torch_dtype(dtype)


def _torch_device(device):
    return None if device is None else torch.device(str(device))


def _copy_into_slices(flat: torch.Tensor, shards) -> None:
    offset = 0
    for s in shards:
        flat[offset : offset + s.numel()].copy_(s.reshape(-1), non_blocking=True)
        offset += s.numel()


def pack_shards_impl(shards, unit: str, dtype, device, group=None) -> torch.Tensor:
    """``group`` None: a flat buffer of the shards alone (no gather around it)."""
    dtype, device = _torch_dtype(dtype) or shards[0].dtype, _torch_device(device) or shards[0].device
    if fb.pack_is_view(len(shards), cast=shards[0].dtype != dtype, moved=shards[0].device != device):
        return shards[0].reshape(-1)
    numel = sum(s.numel() for s in shards)
    ranks, rank = (1, 0) if group is None else (group.size(), group.rank())
    gathered = torch.empty(ranks * numel, dtype=dtype, device=device)  # on the compute stream, which reads it
    flat = gathered[rank * numel : (rank + 1) * numel]
    setattr(flat, GATHERED_BUFFER, gathered)  # its own base: keeps nothing alive that the slice does not
    if device.type == "cuda" and shards[0].device.type == "cpu":  # offloaded: copy on the side stream
        compute, comm = torch.cuda.current_stream(device), communication_stream(device)
        comm.wait_stream(compute)
        with torch.cuda.stream(comm):
            _copy_into_slices(flat, shards)
        setattr(flat, fb.WRITTEN_ON, comm)  # a reader before the all-gather's wait runs after the copy, on comm
    elif all(s.dtype == dtype and s.device == device for s in shards):
        torch.cat([s.reshape(-1) for s in shards], out=flat)
    else:
        _copy_into_slices(flat, shards)
    return flat


def unpack_gathered_impl(gathered: torch.Tensor, unit: str, full_shapes, world_size: int):
    buf = fb.unit_buffer(full_shapes, world_size)
    if fb.unpack_is_view(len(buf.layouts)):  # no copy: rows of the buffer as they lie
        return (_unpadded(gathered, buf.layouts[0]),)
    outs = [torch.empty(world_size, n, dtype=gathered.dtype, device=gathered.device) for n in buf.shard_numels]
    torch.split_with_sizes_copy(gathered.view(world_size, buf.rank_numel), buf.shard_numels, dim=1, out=outs)
    return tuple(_unpadded(o, lay) for o, lay in zip(outs, buf.layouts))


def view_shards_impl(shards, unit: str, full_shapes):
    return tuple(s.view(shape) for s, shape in zip(shards, full_shapes))


def _unpadded(padded: torch.Tensor, lay) -> torch.Tensor:
    """A parameter's padded rows (contiguous, rank-major) -> the parameter, a view (of a prefix, if padded)."""
    if not lay.padding_rows:
        return padded.view(lay.shape)
    return padded.view(lay.padded_rows, *lay.shape[1:])[: lay.rows].view(lay.shape)


def pack_grads_impl(grads, unit: str, full_shapes, world_size: int, dtype, divide_first: int | None) -> torch.Tensor:
    buf = fb.unit_buffer(full_shapes, world_size)
    dtype = _torch_dtype(dtype) or grads[0].dtype
    if fb.pack_is_view(len(grads), buf.layouts[0].padding_rows, grads[0].dtype != dtype, divide_first=divide_first):
        return grads[0].reshape(-1)
    matrix = torch.empty(world_size, buf.rank_numel, dtype=dtype, device=grads[0].device)
    if not buf.padded:  # every gradient is world-size row blocks already: one concatenation (casting on the way)
        torch.cat([g.reshape(world_size, -1) for g in grads], dim=1, out=matrix)
    else:
        offset = 0
        for g, lay, n in zip(grads, buf.layouts, buf.shard_numels):
            _copy_rank_major(matrix[:, offset : offset + n], g, lay)
            offset += n
    flat = matrix.view(-1)
    return flat if divide_first is None else flat.div_(divide_first)


def _copy_rank_major(block: torch.Tensor, grad: torch.Tensor, lay) -> None:
    """``block``: this tensor's (world size, shard elements) columns; rank r's part holds rows r*k .. r*k+k-1
    of the gradient (k rows per rank), zeros past its last row."""
    k, rows = lay.rows_per_rank, grad.reshape(lay.rows, lay.row_numel)
    per_rank = block.view(block.shape[0], k, lay.row_numel)
    full, rest = divmod(lay.rows, k)
    per_rank[:full].copy_(rows[: full * k].view(full, k, lay.row_numel))
    if full < per_rank.shape[0]:
        per_rank[full, :rest].copy_(rows[full * k :])
        per_rank[full, rest:].zero_()
        per_rank[full + 1 :].zero_()


def unpack_grad_shard_impl(local: torch.Tensor, unit: str, shard_shapes, ranks: int, divide: bool, dtype, device):
    if divide and ranks > 1:
        local.div_(ranks)  # the reduction's own output: nobody else holds it
    local = local.to(dtype=_torch_dtype(dtype) or local.dtype, device=_torch_device(device) or local.device)
    if len(shard_shapes) == 1:
        return (local.view(shard_shapes[0]),)
    return tuple(part.view(shape) for part, shape in zip(local.split([prod(s) for s in shard_shapes]), shard_shapes))


for _prim, _name, _impl in (
    (fb.pack_shards, PACK_SHARDS_OP, pack_shards_impl),
    (fb.unpack_gathered, UNPACK_GATHERED_OP, unpack_gathered_impl),
    (fb.view_shards, VIEW_SHARDS_OP, view_shards_impl),
    (fb.pack_grads, PACK_GRADS_OP, pack_grads_impl),
    (fb.unpack_grad_shard, UNPACK_GRAD_SHARD_OP, unpack_grad_shard_impl),
):
    comm_ex.register_implementation(_prim, comm_ex.register_operator(_name, meta=_prim.meta, fn=_impl))
