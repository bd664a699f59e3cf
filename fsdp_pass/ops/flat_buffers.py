"""Flat buffers: how a unit's tensors are laid out in the one buffer its collective sends.

Written in Thunder's torch-level ops, so the layout shows in the printed traces:

- ``pack_flat`` / ``cut_flat``: this rank's shards, flattened and concatenated (what an all-gather sends);
- ``flat_rank_major`` / ``cut_rank_major``: full tensors, zero-padded on dim 0 and laid out rank-major (all of
  rank 0's rows of every tensor, then rank 1's, ...): what an all-gather returns and a reduce-scatter reads.
"""

from __future__ import annotations

import thunder.torch as ltorch

from fsdp_pass.plan.layout import ShardLayout


def layouts_of(full_shapes, world_size):
    return [ShardLayout(tuple(s), world_size) for s in full_shapes]


def flat_rank_major(tensors, layouts, world_size):
    """Lay padded row-major tensors out as one flat buffer: all of rank 0's rows, then rank 1's..."""
    if len(tensors) == 1:
        return ltorch.reshape(tensors[0], (-1,))
    columns = [ltorch.reshape(t, (world_size, lay.shard_numel)) for t, lay in zip(tensors, layouts)]
    return ltorch.reshape(ltorch.cat(columns, 1), (-1,))


def drop_padding(padded, lay: ShardLayout):
    """A parameter's ``padded_rows`` rows (a flat buffer or a column of one) -> the parameter."""
    padded = ltorch.reshape(padded, (lay.padded_rows, *lay.shape[1:]))
    full = padded if lay.padding_rows == 0 else ltorch.getitem(padded, slice(0, lay.rows))
    return full if lay.shape else ltorch.reshape(full, ())


def cut_rank_major(flat, layouts, world_size):
    """Inverse of :func:`flat_rank_major` followed by dropping the padding rows."""
    if len(layouts) == 1:
        return [drop_padding(flat, layouts[0])]
    matrix = ltorch.reshape(flat, (world_size, sum(lay.shard_numel for lay in layouts)))
    out, offset = [], 0
    for lay in layouts:
        out.append(drop_padding(ltorch.getitem(matrix, (slice(None), slice(offset, offset + lay.shard_numel))), lay))
        offset += lay.shard_numel
    return out


def pack_flat(shards):
    """This rank's shards, flattened and concatenated: the buffer its all-gather sends."""
    flat = [ltorch.reshape(s, (-1,)) for s in shards]
    return flat[0] if len(flat) == 1 else ltorch.cat(flat, 0)


def cut_flat(flat, layouts):
    """Split one rank's flat buffer into its shards (no padding to drop: shards keep theirs)."""
    if len(layouts) == 1:
        return [ltorch.reshape(flat, layouts[0].shard_shape)]
    out, offset = [], 0
    for lay in layouts:
        out.append(ltorch.reshape(ltorch.getitem(flat, slice(offset, offset + lay.shard_numel)), lay.shard_shape))
        offset += lay.shard_numel
    return out
