"""``unshard_unit``: the op the pass inserts before a unit's first use, and its gradient rule.

Forward (what the symbol decomposes into, readable in the printed trace; the ops around the collective are
those of :mod:`fsdp_pass.ops.flat_buffers`, which no fusion executor absorbs):
  1. ``pack_shards``: the unit's local shards in one flat buffer, cast to ``param_dtype`` (mixed precision:
     the gather moves fewer bytes) and copied to the compute device (offload), in one op; when it copies,
     into this rank's slice of the gathered buffer it allocates whole;
  2. ``all_gather`` of that buffer (async; in place around the packed slice) and its ``wait``;
  3. ``unpack_gathered``: each parameter cut out of the rank-major gathered buffer, padding rows dropped.
  Over one rank (:func:`~fsdp_pass.plan.gather_rules.gathers_nothing`) steps 1-3 are one ``view_shards``: the parameters are views of the shards.
  Quantized (``gather_dtype``): step 1 is ``quantize_shard``, the shards quantized straight into this rank's slice
  of the gathered buffer (no packed copy), and the gathered codes are dequantized before step 3
  (:mod:`fsdp_pass.ops.quantized_gather`); the gradient rule below is the same, so the gradients of the
  dequantized parameters reach the shards unchanged (straight-through).

Backward (registered with :func:`thunder.core.transforms.register_grad`, so Thunder derives it):
  1. ``pack_grads``: each trainable parameter's full gradient, zero-padded and laid out rank-major in one
     flat buffer in ``reduce_dtype`` (divided by the world size first in float16: a sum of N float16
     gradients can overflow its range, 65504, where bfloat16 and float32 have room);
  2. ``grad_sync=("accumulate", accumulators)`` (inside :func:`fsdp_pass.no_sync`): the buffer is added
     to the unit's unsharded accumulator and the step ends there, with no collective;
     ``("flush", accumulators)`` (the first step after accumulating): the accumulator is added to the
     buffer and emptied;
  3. ``reduce_scatter`` (sum) and its ``wait``: every rank receives the sum of its own shard's part;
  4. HSDP (a replicate group, :mod:`fsdp_pass.shard.mesh`): ``all_reduce`` (sum) of that part over the ranks
     holding the same shard, and its ``wait``: the sum over every rank of the model;
  5. ``unpack_grad_shard``: that part divided by the number of ranks summed (the mean over every rank, on 1/N
     of the buffer), cast back to the shards' dtype, copied to where the shards live, cut into the shard
     gradients.

ZeRO-3 needs no extra op: the pass tags the forward ``unshard_unit`` with
``RECOMPUTE_IN_BACKWARD``, so Thunder's autodiff re-issues the all-gather in the backward instead of
saving the gathered parameters.
"""

from __future__ import annotations

import thunder.torch as ltorch
from thunder.core import dtypes
from thunder.core.symbol import Symbol
from thunder.core.transforms import get_grad, put_grad, register_grad
from thunder.distributed import prims as dist_prims

from fsdp_pass.op_names import UNSHARD_UNIT
from fsdp_pass.ops.flat_buffers import pack_grads, pack_shards, unpack_grad_shard, unpack_gathered, view_shards
from fsdp_pass.ops.grad_accumulation import ACCUMULATE, accumulate_unsharded_grads, add_accumulated_grads
from fsdp_pass.ops.quantized_gather import gather_quantized
from fsdp_pass.plan.gather_rules import gathers_nothing


def _gather(shards, group, unit_name, full_shapes, param_dtype=None, compute_device=None, gather_dtype=None,
            gather_block=None):
    """Forward steps 1-3: the unit's full parameters from every rank's shards (``gather_dtype``: quantized, see
    :mod:`fsdp_pass.ops.quantized_gather`)."""
    if gather_dtype is not None:
        shapes = tuple(tuple(s) for s in full_shapes)
        return gather_quantized(shards, group, unit_name, shapes, param_dtype, compute_device, gather_dtype, gather_block)
    cast = param_dtype if param_dtype is not None and param_dtype != shards[0].dtype else None
    if gathers_nothing(group.size(), cast is not None, compute_device is not None):
        return view_shards(shards, unit_name, tuple(tuple(s) for s in full_shapes))
    flat = pack_shards(shards, unit_name, cast, compute_device, group)
    gathered = dist_prims.wait(dist_prims.all_gather(flat, group, True, None))
    return unpack_gathered(gathered, unit_name, tuple(tuple(s) for s in full_shapes), group.size())


def unshard_unit_meta(
    shards, group, unit_name: str, full_shapes, param_dtype=None, reduce_dtype=None, compute_device=None,
    grad_sync=None, replicate_group=None, gather_dtype=None, gather_block=None,
):
    return _gather(shards, group, unit_name, full_shapes, param_dtype, compute_device, gather_dtype, gather_block)


unshard_unit = Symbol(
    name="unshard_unit",
    meta=unshard_unit_meta,
    id=UNSHARD_UNIT,
    is_prim=False,
)


def reduce_scatter_grads(
    grads, group, unit_name: str, full_shapes, reduce_dtype=None, grad_sync=None, replicate_group=None
):
    """Sum full gradients over every rank, each rank keeping its shard's part: one reduce-scatter over
    ``group``, then (HSDP) one all-reduce of the part over ``replicate_group``. Returns None when ``grad_sync``
    accumulates instead; else ``(the summed part, whether it was divided already)`` (float16 divides the
    packed buffer by the number of ranks first).

    ``grad_sync``: None (reduce now), or ``(mode, accumulators)`` with mode ``"accumulate"`` (add to the
    unit's accumulator and return None: no collective) or ``"flush"`` (add the unit's accumulator, empty
    it, then reduce); ``accumulators``: the transform's
    :class:`~fsdp_pass.ops.grad_accumulation.GradAccumulators`.
    """
    world_size = group.size()
    ranks = world_size * (1 if replicate_group is None else replicate_group.size())
    dtype = reduce_dtype or grads[0].dtype
    divide_first = ranks if dtype in _OVERFLOWING_SUMS else None  # a sum of averages stays in range
    flat = pack_grads(grads, unit_name, tuple(tuple(s) for s in full_shapes), world_size, reduce_dtype, divide_first)
    if grad_sync is not None:
        mode, accumulators = grad_sync
        if mode == ACCUMULATE:
            accumulate_unsharded_grads(flat, unit_name, accumulators)
            return None
        flat = add_accumulated_grads(flat, unit_name, accumulators)
    local = dist_prims.wait(dist_prims.reduce_scatter(flat, dist_prims.DistributedReduceOps.SUM, group, True, None))
    if replicate_group is not None:  # in place: the reduce-scatter's output is nobody else's
        local = dist_prims.wait(
            dist_prims.all_reduce(local, dist_prims.DistributedReduceOps.SUM, replicate_group, True, True)
        )
    return local, divide_first is not None


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
    shards, group, unit_name, full_shapes, param_dtype=None, reduce_dtype=None, compute_device=None,
    grad_sync=None, replicate_group=None, gather_dtype=None, gather_block=None,
):
    fulls = _gather(shards, group, unit_name, full_shapes, param_dtype, compute_device, gather_dtype, gather_block)
    trainable = [i for i, s in enumerate(shards) if s.requires_grad]
    if not trainable:
        return fulls
    grads = [_reduce_scalar_grad(get_grad(fulls[i]), full_shapes[i]) for i in trainable]
    reduced = reduce_scatter_grads(
        grads, group, unit_name, [full_shapes[i] for i in trainable], reduce_dtype, grad_sync, replicate_group
    )
    if reduced is None:  # accumulated, not reduced: the shards get no gradient this step
        return fulls
    local, divided = reduced
    home = shards[trainable[0]]  # the optimizer steps on the shards' dtype and device (the master weights)
    shard_shapes = tuple(tuple(shards[i].shape) for i in trainable)
    ranks = group.size() * (1 if replicate_group is None else replicate_group.size())
    shard_grads = unpack_grad_shard(
        local, unit_name, shard_shapes, ranks, not divided,
        None if home.dtype == local.dtype else home.dtype,
        None if compute_device is None else home.device.device_str(),
    )
    for i, g in zip(trainable, shard_grads):
        put_grad(shards[i], g)
    return fulls


register_grad(unshard_unit.id, _unshard_unit_grad)
