"""The ``fsdp_comm`` executor's torch code for the ops around a unit's collectives (:mod:`fsdp_pass.ops.flat_buffers`).

In a printed execution trace they read ``fsdp_pack_shards``, ``fsdp_unpack_gathered``, ``fsdp_pack_grads`` and
``fsdp_unpack_grad_shard``. Being this executor's ops, no fusion executor takes them into a fusion region.

- Packing copies each shard into its slice of one flat buffer, casting on the way (one pass, no second
  copy for mixed precision). Shards offloaded to pinned host memory are copied to the GPU on the
  communication stream, after it waits for the compute stream, so the copy runs while the compute stream
  goes on and the all-gather that reads the buffer follows it on the same stream.
- Unpacking a gathered buffer copies each parameter out of the rank-major layout with one
  ``split_with_sizes_copy`` (one kernel on CUDA); padding rows are dropped as a view of a prefix.
- Packing gradients copies each into its column block of a (world size, shard elements) buffer in the
  reduce dtype, padding rows zeroed; unpacking the reduced shard divides it in place, casts it to the shards'
  dtype, copies it to where the shards live (a blocking copy: the optimizer reads it on the host next), and
  cuts the shard gradients out of it as views.
"""

from __future__ import annotations

import torch
from fsdp_pass_executors.collectives import comm_ex, communication_stream
from thunder.core.dtypes import to_torch_dtype

from fsdp_pass.op_names import PACK_GRADS_OP, PACK_SHARDS_OP, UNPACK_GATHERED_OP, UNPACK_GRAD_SHARD_OP
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


def pack_shards_impl(shards, unit: str, dtype, device) -> torch.Tensor:
    dtype, device = _torch_dtype(dtype) or shards[0].dtype, _torch_device(device) or shards[0].device
    if fb.pack_is_view(len(shards), cast=shards[0].dtype != dtype, moved=shards[0].device != device):
        return shards[0].reshape(-1)
    numel = sum(s.numel() for s in shards)
    if device.type == "cuda" and shards[0].device.type == "cpu":  # offloaded: copy on the side stream
        compute, comm = torch.cuda.current_stream(device), communication_stream(device)
        comm.wait_stream(compute)
        with torch.cuda.stream(comm):
            flat = torch.empty(numel, dtype=dtype, device=device)
            _copy_into_slices(flat, shards)
        return flat
    if all(s.dtype == dtype for s in shards):
        return torch.cat([s.reshape(-1) for s in shards]).to(device)
    flat = torch.empty(numel, dtype=dtype, device=device)
    _copy_into_slices(flat, shards)
    return flat


def unpack_gathered_impl(gathered: torch.Tensor, unit: str, full_shapes, world_size: int):
    layouts = fb.layouts_of(full_shapes, world_size)
    if len(layouts) == 1:
        return (_unpadded(gathered, layouts[0]),)
    sizes = [lay.shard_numel for lay in layouts]
    outs = [torch.empty(world_size, n, dtype=gathered.dtype, device=gathered.device) for n in sizes]
    torch.split_with_sizes_copy(gathered.view(world_size, sum(sizes)), sizes, dim=1, out=outs)
    return tuple(_unpadded(o, lay) for o, lay in zip(outs, layouts))


def _unpadded(padded: torch.Tensor, lay) -> torch.Tensor:
    """A parameter's padded rows (contiguous, rank-major) -> the parameter, a view of a prefix."""
    return padded.view(lay.padded_rows, *lay.shape[1:])[: lay.rows].view(lay.shape)


def pack_grads_impl(grads, unit: str, full_shapes, world_size: int, dtype, divide_first: bool) -> torch.Tensor:
    layouts = fb.layouts_of(full_shapes, world_size)
    dtype = _torch_dtype(dtype) or grads[0].dtype
    if fb.pack_is_view(len(grads), layouts[0].padding_rows, grads[0].dtype != dtype, divide_first=divide_first):
        return grads[0].reshape(-1)
    total = sum(lay.shard_numel for lay in layouts)
    matrix = torch.empty(world_size, total, dtype=dtype, device=grads[0].device)
    offset = 0
    for g, lay in zip(grads, layouts):
        _copy_rank_major(matrix[:, offset : offset + lay.shard_numel], g, lay)
        offset += lay.shard_numel
    flat = matrix.view(-1)
    return flat.div_(world_size) if divide_first else flat


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


def unpack_grad_shard_impl(local: torch.Tensor, unit: str, shard_shapes, world_size: int, divide: bool, dtype, device):
    if divide:
        local.div_(world_size)  # the reduce-scatter's own output: nobody else holds it
    local = local.to(dtype=_torch_dtype(dtype) or local.dtype, device=_torch_device(device) or local.device)
    out, offset = [], 0
    for shape in shard_shapes:
        n = int(torch.Size(shape).numel())
        out.append(local[offset : offset + n].view(shape))
        offset += n
    return tuple(out)


for _prim, _name, _impl in (
    (fb.pack_shards, PACK_SHARDS_OP, pack_shards_impl),
    (fb.unpack_gathered, UNPACK_GATHERED_OP, unpack_gathered_impl),
    (fb.pack_grads, PACK_GRADS_OP, pack_grads_impl),
    (fb.unpack_grad_shard, UNPACK_GRAD_SHARD_OP, unpack_grad_shard_impl),
):
    comm_ex.register_implementation(_prim, comm_ex.register_operator(_name, meta=_prim.meta, fn=_impl))
