"""Two rules of how a unit's gather runs, which the ops that run it (:mod:`fsdp_pass.ops`) follow and the memory
model (:mod:`fsdp_pass.cost`) counts by: ``gathers_nothing(world_size, cast, moved)``, whether the gather is the
shards themselves, and ``unpack_is_view(count)``, whether unpacking the gathered buffer copies nothing. Here,
before both stages, so that each reads the one definition.
"""

from __future__ import annotations


def gathers_nothing(world_size: int, cast: bool, moved: bool) -> bool:
    """Whether a unit's gather is its shards themselves: over a group of one rank, where a shard is the whole
    parameter (no padding rows), not cast (mixed precision) nor copied to another device (offload) nor quantized.
    The unit's parameters are then views of its shards (a reshape: a 0-d parameter's shard has one row), with no
    packing, collective or copy-out, so a unit kept gathered for the backward holds no bytes more than one
    resharded, and the backward's gather of a resharded unit is those views again. The memory model
    (:mod:`fsdp_pass.cost.step_summary`) counts by this rule; :mod:`fsdp_pass.ops.unshard` runs by it."""
    return world_size == 1 and not (cast or moved)


def unpack_is_view(count: int) -> bool:
    """Whether unpacking a gathered buffer returns views of it and copies nothing: one parameter (its padding
    rows dropped as a view of a prefix). Several parameters are copied out, at world size 1 too, where views
    would need no copy: the forward may keep one of them for the backward (a norm's weight, broadcast), and a
    view keeps the whole buffer alive, so a unit resharded after forward would stay gathered until its
    backward."""
    return count == 1
