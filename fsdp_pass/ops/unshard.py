"""``unshard_unit``: the op the pass inserts before a unit's first use, and its gradient rule.

Forward (what the symbol decomposes into, readable in the printed trace):
  1. pack: the unit's local shards, flattened and concatenated into one flat buffer;
  2. offload only: that buffer copied from where the shards live (the CPU) to the compute device;
  3. mixed precision only: that buffer cast to ``param_dtype``, so the gather moves fewer bytes;
  4. ``all_gather`` of that buffer (async) and its ``wait``;
  5. unpack: each parameter cut out of the rank-major gathered buffer, padding rows dropped.

Backward (registered with :func:`thunder.core.transforms.register_grad`, so Thunder derives it):
  1. each trainable parameter's full gradient padded with zero rows and laid out rank-major;
  2. one flat buffer, cast to ``reduce_dtype`` if set;
  3. ``grad_sync=("accumulate", accumulators)`` (inside :func:`fsdp_pass.no_sync`): the buffer is added
     to the unit's unsharded accumulator and the step ends there, with no collective;
     ``("flush", accumulators)`` (the first step after accumulating): the accumulator is added to the
     buffer and emptied;
  4. ``reduce_scatter`` (sum) and its ``wait``: every rank receives the sum of its own shard's part;
  5. divided by the world size: the mean over ranks, computed on the shard (1/N of the buffer). Only
     in float16 is the full buffer divided *before* the reduce-scatter: a sum of N float16 gradients
     can overflow its range (65504), where bfloat16 and float32 have room;
  6. cast back to the shards' dtype and, offload only, copied back to where the shards live;
  7. the shard gradients cut out of it.

ZeRO-3 needs no extra op: the pass tags the forward ``unshard_unit`` with
``RECOMPUTE_IN_BACKWARD``, so Thunder's autodiff re-issues the all-gather in the backward instead of
saving the gathered parameters.
"""

from __future__ import annotations

import thunder.torch as ltorch
from thunder.core import dtypes
from thunder.core.symbol import Symbol, bsym_header
from thunder.core.transforms import get_grad, put_grad, register_grad
from thunder.distributed import prims as dist_prims

from fsdp_pass.op_names import ALL_GATHER, REDUCE_SCATTER, UNSHARD_UNIT
from fsdp_pass.ops.flat_buffers import cut_flat, cut_rank_major, flat_rank_major, layouts_of, pack_flat
from fsdp_pass.ops.grad_accumulation import ACCUMULATE, accumulate_unsharded_grads, add_accumulated_grads
from fsdp_pass.text import collective_label


def _describe(unit_name, kind, layouts, itemsize, world_size):
    shard_numel = sum(lay.shard_numel for lay in layouts)
    padding = sum(lay.padding_numel for lay in layouts)
    return collective_label(unit_name, kind, len(layouts), shard_numel * itemsize, world_size, padding)


def _gather(shards, group, unit_name, full_shapes, param_dtype=None, compute_device=None):
    world_size = group.size()
    layouts = layouts_of(full_shapes, world_size)
    flat = pack_flat(shards)
    if compute_device is not None:
        with bsym_header(f"[fsdp] unit {unit_name!r}: copy the shards from {flat.device} to {compute_device}"):
            flat = ltorch.to(flat, compute_device, copy=True)
    if param_dtype is not None and param_dtype != flat.dtype:
        with bsym_header(f"[fsdp] unit {unit_name!r}: cast the shards to {param_dtype} before the gather"):
            flat = ltorch.to(flat, param_dtype)
    with bsym_header(_describe(unit_name, ALL_GATHER, layouts, flat.dtype.bytes, world_size)):
        gathered = dist_prims.wait(dist_prims.all_gather(flat, group, True, None))
    return cut_rank_major(gathered, layouts, world_size)


def unshard_unit_meta(
    shards, group, unit_name: str, full_shapes, param_dtype=None, reduce_dtype=None, compute_device=None, grad_sync=None
):
    return _gather(shards, group, unit_name, full_shapes, param_dtype, compute_device)


unshard_unit = Symbol(
    name="unshard_unit",
    meta=unshard_unit_meta,
    id=UNSHARD_UNIT,
    is_prim=False,
)


def _flat_grads(grads, layouts, world_size, reduce_dtype):
    """Full gradients -> one rank-major flat buffer (zero padding rows), in ``reduce_dtype`` if set."""
    same_dtype = all(g.dtype == grads[0].dtype for g in grads)
    if reduce_dtype is not None and not same_dtype:
        grads = [ltorch.to(g, reduce_dtype) for g in grads]  # one dtype before packing
    padded = []
    for g, lay in zip(grads, layouts):
        rows = ltorch.reshape(g, (lay.rows, lay.row_numel))
        if lay.padding_rows:
            rows = ltorch.pad(rows, (0, 0, 0, lay.padding_rows))
        padded.append(rows)
    flat = flat_rank_major(padded, layouts, world_size)
    if reduce_dtype is not None and flat.dtype != reduce_dtype:
        flat = ltorch.to(flat, reduce_dtype)  # packed first: the cast copies once, from the smaller dtype
    return flat


def reduce_scatter_grads(grads, group, unit_name: str, full_shapes, reduce_dtype=None, grad_sync=None):
    """Average full gradients over ranks and give each rank its shard's part (one reduce-scatter, then
    a division of that part by the world size; in float16 the division comes first).

    ``grad_sync``: None (reduce now), or ``(mode, accumulators)`` with mode ``"accumulate"`` (add to the
    unit's accumulator and return None: no collective) or ``"flush"`` (add the unit's accumulator, empty
    it, then reduce); ``accumulators``: the transform's
    :class:`~fsdp_pass.ops.grad_accumulation.GradAccumulators`.
    """
    world_size = group.size()
    layouts = layouts_of(full_shapes, world_size)
    flat = _flat_grads(grads, layouts, world_size, reduce_dtype)
    if grad_sync is not None:
        mode, accumulators = grad_sync
        if mode == ACCUMULATE:
            with bsym_header(f"[fsdp] unit {unit_name!r}: no_sync: add the unsharded gradients to its accumulator"):
                accumulate_unsharded_grads(flat, accumulators, unit_name)
            return None
        with bsym_header(f"[fsdp] unit {unit_name!r}: add the gradients accumulated under no_sync (and empty them)"):
            flat = add_accumulated_grads(flat, accumulators, unit_name)
    divide_first = flat.dtype in _OVERFLOWING_SUMS
    if divide_first:  # a sum of averages stays in range
        flat = ltorch.true_divide(flat, world_size)
    with bsym_header(_describe(unit_name, REDUCE_SCATTER, layouts, flat.dtype.bytes, world_size)):
        local = dist_prims.wait(dist_prims.reduce_scatter(flat, dist_prims.DistributedReduceOps.SUM, group, True, None))
    return local if divide_first else ltorch.true_divide(local, world_size)


# dtypes in which the sum of N gradients can overflow, so the reduce-scatter sums averages instead
_OVERFLOWING_SUMS = (dtypes.float16, dtypes.float16_)


def _reduce_scalar_grad(grad, shape):
    """Make sure the gradient of a 0-d parameter is 0-d.

    Thunder 0.2.6 treats a 0-d tensor operand like a number: ``x / scale`` gives ``scale`` a gradient of
    ``x``'s shape, and relies on torch autograd to sum it at the inputs. Our gathered parameters are not
    autograd inputs, so the rule sums it here. The proxy still says 0-d when the rule is built (the real
    gradient is swapped in later), so the reduction must be right for any runtime shape: flatten with
    ``-1`` (kept literally in the executed call) and sum.
    """
    if len(shape) != 0:
        return grad
    return ltorch.sum(ltorch.reshape(grad, (-1,)), 0)


def _unshard_unit_grad(
    shards, group, unit_name, full_shapes, param_dtype=None, reduce_dtype=None, compute_device=None, grad_sync=None
):
    fulls = _gather(shards, group, unit_name, full_shapes, param_dtype, compute_device)
    trainable = [i for i, s in enumerate(shards) if s.requires_grad]
    if not trainable:
        return fulls
    grads = [_reduce_scalar_grad(get_grad(fulls[i]), full_shapes[i]) for i in trainable]
    shapes = [full_shapes[i] for i in trainable]
    local = reduce_scatter_grads(grads, group, unit_name, shapes, reduce_dtype, grad_sync)
    if local is None:  # accumulated, not reduced: the shards get no gradient this step
        return fulls
    home = shards[trainable[0]]
    if local.dtype != home.dtype:
        local = ltorch.to(local, home.dtype)  # the optimizer steps on the shards' dtype (the master weights)
    if compute_device is not None:
        with bsym_header(f"[fsdp] unit {unit_name!r}: copy the shard gradients back to {home.device}"):
            local = ltorch.to(local, home.device, copy=True)
    for i, g in zip(trainable, cut_flat(local, layouts_of(shapes, group.size()))):
        put_grad(shards[i], g)
    return fulls


register_grad(unshard_unit.id, _unshard_unit_grad)
