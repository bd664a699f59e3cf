"""The ops around a unit's collectives: how its tensors go into the one buffer a collective moves, and out.

- ``pack_shards(shards, unit, dtype, device, group)``: this rank's shards, flattened and concatenated into
  the buffer its all-gather sends; cast to ``dtype`` (mixed precision) and copied to ``device`` (offload) in
  the same op. One shard, no cast and no copy: a view of it. Otherwise the op allocates the whole gathered
  buffer (``group``'s size times the shards) and packs into this rank's slice of it, which it returns; the
  all-gather then fills that buffer in place around it (:func:`gathers_in_place`), so no send buffer lives
  beside the gathered one (at world size 1 the packed shards are the gathered buffer).
- ``unpack_gathered(gathered, unit, full_shapes, world_size)``: the rank-major gathered buffer (all of rank
  0's part of every parameter, then rank 1's, ...) cut into the full parameters, padding rows dropped; one
  copy-out per unit (a view of the buffer for a one-parameter unit).
- ``view_shards(shards, unit, full_shapes)``: a gather over one rank (:func:`~fsdp_pass.plan.gather_rules.gathers_nothing`):
  each shard reshaped to its parameter's shape, a view; nothing packed, gathered or copied. One op per unit, so
  the unit is named in the trace where its gather would be, and the finite checks have their anchor.
- ``pack_grads(grads, unit, full_shapes, world_size, dtype, divide_first)``: full gradients laid out rank-major
  with zero padding rows, in the reduce ``dtype``: the buffer the reduce-scatter reads (divided first by
  ``divide_first``, the number of ranks whose gradients are summed, as float16 needs; None: not divided).
- ``unpack_grad_shard(local, unit, shard_shapes, ranks, divide, dtype, device)``: the reduced part for this
  rank, divided by ``ranks``, the number of ranks summed (unless already), cast to the shards' ``dtype`` and
  copied to their ``device``, cut into the shard gradients.

They are single ops on purpose. A fusion executor (nvFuser, Thunder's torchcompile) claims every op it can
between two it cannot; written as torch-level ops, the packing of unit k+1 would be fused into unit k's
compute (so its all-gather could start only when that ends), and the division of a reduced shard into the
next compute (so its wait would come right after the reduce-scatter). Claimed by ``fsdp_comm`` instead
(:mod:`fsdp_pass_executors.buffers`), they stay where the scheduling pass puts them, under any executor
list. Each takes its unit's name, so its label (and that of the collective it feeds) is read off the op
itself in the final trace. The meta functions here give shapes, dtypes and devices; the torch code is
the executor's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from thunder.core import devices, prims
from thunder.core.proxies import TensorProxy

from fsdp_pass.op_names import PACK_GRADS, PACK_SHARDS, UNPACK_GATHERED, UNPACK_GRAD_SHARD, VIEW_SHARDS
from fsdp_pass.plan.gather_rules import unpack_is_view
from fsdp_pass.plan.layout import ShardLayout
from fsdp_pass.predicates import (
    collective_group,
    is_all_gather,
    is_pack_grads,
    is_pack_shards,
    is_reduce_scatter,
    is_unpack_gathered,
    is_unpack_grad_shard,
    is_view_shards,
)


# the attribute of a flat buffer that a stream other than the compute stream fills (an offloaded unit's shards are
# copied to the device on the communication stream, where its all-gather follows): that stream. An op that reads the
# buffer before the collective's wait orders itself after that stream's work: the finite check of the packed shard
# runs on it (fsdp_pass.ops.finite_checks). Set by the executor's pack op (fsdp_pass_executors.buffers).
WRITTEN_ON = "fsdp_written_on"


@dataclass(frozen=True)
class UnitBuffer:
    """How one unit's parameters lie in its flat buffers at one world size, worked out once per unit (the ops
    run every step, with the same shapes)."""

    layouts: tuple[ShardLayout, ...]
    shard_numels: tuple[int, ...]  # each parameter's elements in one rank's part
    padded: bool  # whether any parameter has padding rows

    @property
    def rank_numel(self) -> int:
        return sum(self.shard_numels)


@lru_cache(maxsize=4096)
def unit_buffer(full_shapes: tuple, world_size: int) -> UnitBuffer:
    layouts = tuple(ShardLayout(tuple(s), world_size) for s in full_shapes)
    return UnitBuffer(layouts, tuple(lay.shard_numel for lay in layouts), any(lay.padding_rows for lay in layouts))


def layouts_of(full_shapes, world_size: int) -> tuple[ShardLayout, ...]:
    return unit_buffer(tuple(map(tuple, full_shapes)), world_size).layouts


def _device(device):
    return None if device is None else devices.to_device(device)


def _pack_shards_meta(shards, unit: str, dtype, device, group=None) -> TensorProxy:
    numel = sum(s.numel for s in shards)
    return TensorProxy(like=shards[0], shape=(numel,), dtype=dtype or shards[0].dtype,
                       device=_device(device) or shards[0].device)


def _unpack_gathered_meta(gathered, unit: str, full_shapes, world_size: int) -> tuple:
    return tuple(TensorProxy(like=gathered, shape=tuple(s)) for s in full_shapes)


def _view_shards_meta(shards, unit: str, full_shapes) -> tuple:
    return tuple(TensorProxy(like=s, shape=tuple(shape)) for s, shape in zip(shards, full_shapes))


def _pack_grads_meta(grads, unit: str, full_shapes, world_size: int, dtype, divide_first: int | None) -> TensorProxy:
    numel = world_size * sum(lay.shard_numel for lay in layouts_of(full_shapes, world_size))
    return TensorProxy(like=grads[0], shape=(numel,), dtype=dtype or grads[0].dtype)


def _unpack_grad_shard_meta(local, unit: str, shard_shapes, ranks: int, divide: bool, dtype, device) -> tuple:
    return tuple(
        TensorProxy(like=local, shape=tuple(s), dtype=dtype or local.dtype, device=_device(device) or local.device)
        for s in shard_shapes
    )


pack_shards = prims.make_prim(PACK_SHARDS, "pack_shards", meta=_pack_shards_meta)
unpack_gathered = prims.make_prim(UNPACK_GATHERED, "unpack_gathered", meta=_unpack_gathered_meta)
view_shards = prims.make_prim(VIEW_SHARDS, "view_shards", meta=_view_shards_meta)
pack_grads = prims.make_prim(PACK_GRADS, "pack_grads", meta=_pack_grads_meta)
unpack_grad_shard = prims.make_prim(UNPACK_GRAD_SHARD, "unpack_grad_shard", meta=_unpack_grad_shard_meta)


def pack_is_view(count: int, padding_rows: int = 0, cast: bool = False, moved: bool = False,
                 divide_first: int | None = None) -> bool:
    """Whether a pack op returns its input flattened, a view and no new buffer: one tensor, no padding rows to
    add, no cast, no device copy, no division. The executor's code follows this rule and the memory model
    (:func:`views_of_inputs`) counts by it."""
    return count == 1 and not (padding_rows or cast or moved or divide_first is not None)


def gathers_in_place(bsym) -> bool:
    """Whether pack op ``bsym`` packs into this rank's slice of the buffer its all-gather fills: whenever it copies
    (:func:`pack_is_view` is false) and knows its group. The executor's code follows this rule and the memory
    model counts by it: the pack op allocates the whole gathered buffer, the all-gather writes no new one."""
    shards, _, dtype, device, group = bsym.args
    return group is not None and not _pack_is_view_op(shards, dtype, device)


def pack_copies_to_device(bsym) -> str | None:
    """The device pack op ``bsym`` copies the shards to (offloaded shards: the compute device), or None where it
    reads them where they live. On CUDA the executor runs that copy on the communication stream
    (:data:`WRITTEN_ON`)."""
    shards, _, _, device, _ = bsym.args
    moved = _device(device)
    return None if moved in (None, shards[0].device) else moved.device_str()


def _pack_is_view_op(shards, dtype, device) -> bool:
    cast, moved = dtype not in (None, shards[0].dtype), _device(device) not in (None, shards[0].device)
    return pack_is_view(len(shards), cast=cast, moved=moved)


def collective_returns_input(bsym) -> bool:
    """Whether collective ``bsym`` (an all-gather or a reduce-scatter) returns its input, a view, and writes no new
    buffer: over a group of one rank, where the gathered buffer is the packed shards and the summed part is the
    packed gradients (nothing to gather, sum or move). The executor's code follows this rule and the memory model
    counts by it."""
    return (is_all_gather(bsym) or is_reduce_scatter(bsym)) and collective_group(bsym).size() == 1


def allocated_bytes(bsym, out) -> int:
    """Bytes of the new buffer that output ``out`` of one of these ops is: a parameter copied out of a gathered
    buffer keeps its padding rows (the op returns a view of the unpadded prefix); shards packed in place are
    one slice of the whole gathered buffer the op allocates (:func:`gathers_in_place`)."""
    if is_pack_shards(bsym) and gathers_in_place(bsym):
        return int(out.numel) * out.dtype.bytes * bsym.args[4].size()
    if is_unpack_gathered(bsym):
        _, _, full_shapes, world_size = bsym.args
        lay = layouts_of(full_shapes, world_size)[[o.name for o in bsym.flat_proxy_outs].index(out.name)]
        return lay.padded_rows * lay.row_numel * out.dtype.bytes
    return int(out.numel) * out.dtype.bytes


def views_of_inputs(bsym) -> dict[str, object]:
    """Output name -> the input proxy it is a view of, for the outputs of these ops that allocate nothing
    (what the memory model needs: everything else they return is a new buffer)."""
    args, outs = bsym.args, bsym.flat_proxy_outs
    if is_pack_shards(bsym):
        shards, _, dtype, device, _ = args
        return {outs[0].name: shards[0]} if _pack_is_view_op(shards, dtype, device) else {}
    if is_unpack_gathered(bsym):
        return {o.name: args[0] for o in outs} if unpack_is_view(len(outs)) else {}
    if is_view_shards(bsym):
        return {o.name: shard for o, shard in zip(outs, args[0])}
    if is_pack_grads(bsym):
        grads, _, full_shapes, world_size, dtype, divide_first = args
        padding_rows = layouts_of(full_shapes, world_size)[0].padding_rows
        cast = dtype not in (None, grads[0].dtype)
        view = pack_is_view(len(grads), padding_rows, cast, divide_first=divide_first)
        return {outs[0].name: grads[0]} if view else {}
    if is_unpack_grad_shard(bsym):
        local, _, _, _, _, dtype, device = args
        same = dtype in (None, local.dtype) and _device(device) in (None, local.device)
        return {o.name: local for o in outs} if same else {}
    return {}

