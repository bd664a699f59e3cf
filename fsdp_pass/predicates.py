"""Named predicates over bound symbols, keyed on symbol ids (never on printed text), and over their proxies.

The ids come from Thunder (its prims) and from :mod:`fsdp_pass.op_names` (this project's ops and the
names its executor and Thunder's torch executor give the lowered collectives).
"""

from __future__ import annotations

import thunder.torch as ltorch
from thunder.core import dtypes, prims
from thunder.core.proxies import TensorProxy
from thunder.distributed.prims import PrimIDs as DistIDs

from fsdp_pass.op_names import (
    ACCUMULATE_OP,
    ACCUMULATE_UNSHARDED_GRADS,
    ADD_ACCUMULATED_GRADS,
    ADD_ACCUMULATED_OP,
    ALL_GATHER_OP,
    ALL_REDUCE_OP,
    AWAIT_STEP_DIGESTS,
    CHECK_FINITE,
    CHECK_SAME_COLLECTIVES,
    CLEAR_FINITE_FLAGS,
    DEQUANTIZE_GATHERED,
    DEQUANTIZE_GATHERED_OP,
    EXCHANGE_STEP_DIGEST,
    PACK_GRADS,
    PACK_GRADS_OP,
    PACK_SHARDS,
    PACK_SHARDS_OP,
    QUANTIZE_SHARD,
    QUANTIZE_SHARD_OP,
    RAISE_IF_NONFINITE,
    REDUCE_SCATTER_OP,
    TORCH_ALL_GATHER_OP,
    TORCH_ALL_REDUCE_OP,
    TORCH_REDUCE_SCATTER_OP,
    TORCH_WAIT_OP,
    UNPACK_GATHERED,
    UNPACK_GATHERED_OP,
    UNPACK_GRAD_SHARD,
    UNPACK_GRAD_SHARD_OP,
    UNSHARD_UNIT,
    VIEW_SHARDS,
    VIEW_SHARDS_OP,
    WAIT_OP,
    CollectiveKind,
)

# lowered: Thunder's torch executor, and fsdp_pass_executors.collectives
_ALL_GATHER_IMPL = (TORCH_ALL_GATHER_OP, ALL_GATHER_OP)
_REDUCE_SCATTER_IMPL = (TORCH_REDUCE_SCATTER_OP, REDUCE_SCATTER_OP)
_ALL_REDUCE_IMPL = (TORCH_ALL_REDUCE_OP, ALL_REDUCE_OP)
_WAIT_IMPL = (TORCH_WAIT_OP, WAIT_OP)


def _id(bsym):
    return bsym.sym.id


def is_all_gather(bsym) -> bool:
    return _id(bsym) in (DistIDs.ALL_GATHER, *_ALL_GATHER_IMPL)


def is_reduce_scatter(bsym) -> bool:
    return _id(bsym) in (DistIDs.REDUCE_SCATTER, *_REDUCE_SCATTER_IMPL)


def is_all_reduce(bsym) -> bool:
    return _id(bsym) in (DistIDs.ALL_REDUCE, *_ALL_REDUCE_IMPL)


def is_wait(bsym) -> bool:
    return _id(bsym) in (DistIDs.WAIT, *_WAIT_IMPL)


def is_collective(bsym) -> bool:
    return is_all_gather(bsym) or is_reduce_scatter(bsym) or is_all_reduce(bsym)


def collective_kind(bsym) -> CollectiveKind | None:
    """Which collective ``bsym`` issues (None if it is none)."""
    if is_all_gather(bsym):
        return CollectiveKind.ALL_GATHER
    if is_reduce_scatter(bsym):
        return CollectiveKind.REDUCE_SCATTER
    if is_all_reduce(bsym):
        return CollectiveKind.ALL_REDUCE
    return None


def collective_group(bsym):
    """The process group collective ``bsym`` runs on: ``all_gather(a, group, ...)``, ``reduce_scatter(a, op,
    group, ...)``, ``all_reduce(a, op, group, ...)``."""
    return bsym.args[1] if is_all_gather(bsym) else bsym.args[2]


def is_unshard_unit(bsym) -> bool:
    return _id(bsym) == UNSHARD_UNIT


# the ops around a unit's collectives (fsdp_pass.ops.flat_buffers, grad_accumulation), before and after lowering
_PACK_SHARDS = (PACK_SHARDS, PACK_SHARDS_OP)
_UNPACK_GATHERED = (UNPACK_GATHERED, UNPACK_GATHERED_OP)
_VIEW_SHARDS = (VIEW_SHARDS, VIEW_SHARDS_OP)  # a gather over one rank: fsdp_pass.plan.gather_rules.gathers_nothing
_PACK_GRADS = (PACK_GRADS, PACK_GRADS_OP)
_UNPACK_GRAD_SHARD = (UNPACK_GRAD_SHARD, UNPACK_GRAD_SHARD_OP)
_ACCUMULATION = (ACCUMULATE_UNSHARDED_GRADS, ACCUMULATE_OP, ADD_ACCUMULATED_GRADS, ADD_ACCUMULATED_OP)
_QUANTIZE_SHARD = (QUANTIZE_SHARD, QUANTIZE_SHARD_OP)  # MixedPrecision(gather_dtype=...): fsdp_pass.ops.quantized_gather
_DEQUANTIZE_GATHERED = (DEQUANTIZE_GATHERED, DEQUANTIZE_GATHERED_OP)
_BUFFER_OPS = frozenset(
    _PACK_SHARDS + _UNPACK_GATHERED + _VIEW_SHARDS + _PACK_GRADS + _UNPACK_GRAD_SHARD + _QUANTIZE_SHARD + _DEQUANTIZE_GATHERED
)
_UNIT_OPS = _BUFFER_OPS | frozenset(_ACCUMULATION)


def is_pack_shards(bsym) -> bool:
    return _id(bsym) in _PACK_SHARDS


def is_view_shards(bsym) -> bool:
    return _id(bsym) in _VIEW_SHARDS


def is_unpack_gathered(bsym) -> bool:
    return _id(bsym) in _UNPACK_GATHERED


def is_quantize_shard(bsym) -> bool:
    """This rank's shards quantized into its slice of the uint8 buffer of codes and scales its all-gather fills."""
    return _id(bsym) in _QUANTIZE_SHARD


def is_dequantize_gathered(bsym) -> bool:
    """A quantized gathered buffer turned back into the compute dtype (before ``unpack_gathered``)."""
    return _id(bsym) in _DEQUANTIZE_GATHERED


def is_pack_grads(bsym) -> bool:
    return _id(bsym) in _PACK_GRADS


def is_unpack_grad_shard(bsym) -> bool:
    return _id(bsym) in _UNPACK_GRAD_SHARD


def is_grad_accumulation(bsym) -> bool:
    """``no_sync``'s ops: add a unit's unsharded gradients to its accumulator, or the accumulator to them."""
    return _id(bsym) in _ACCUMULATION


def is_unit_op(bsym) -> bool:
    """One of the pass's ops that pack, unpack or accumulate a unit's buffer; its second argument is the
    unit's name."""
    return _id(bsym) in _UNIT_OPS


def unit_of_op(bsym) -> str | None:
    """The unit a pack, unpack or accumulation op works for (None for any other op)."""
    return bsym.args[1] if is_unit_op(bsym) else None


def is_unpack_parameter(bsym) -> bool:
    return bsym.sym is prims.unpack_parameter


def is_shape_check(bsym) -> bool:
    return bsym.sym is prims.check_tensor_shape_and_metadata


def is_return(bsym) -> bool:
    return bsym.sym is prims.python_return


def is_clone(bsym) -> bool:
    """A copy of a tensor (``clone``), before lowering or after."""
    return _id(bsym) in (prims.PrimIDs.CLONE, "clone")


def is_copy_into(bsym) -> bool:
    """``copy_(value, destination)``: how Thunder writes an in-place op's result into its tensor."""
    return _id(bsym) in (prims.PrimIDs.COPY_, "copy_")


def is_in_place(bsym) -> bool:
    """An op Thunder tags as writing into its input (``a /= b``, ``x.add_(y)``)."""
    return prims.OpTags.IN_PLACE in (bsym.sym.tags or ())


def is_float_tensor(proxy) -> bool:
    """A tensor proxy of a floating-point dtype."""
    return isinstance(proxy, TensorProxy) and dtypes.is_float_dtype(proxy.dtype)


def is_unpack_trivial(bsym) -> bool:
    return bsym.sym is prims.unpack_trivial


def is_unpack_buffer(bsym) -> bool:
    return bsym.sym is prims.unpack_buffer


def is_unpack_submodule(bsym) -> bool:
    return _id(bsym) == prims.PrimIDs.UNPACK_SUBMODULE


def is_unpack_attr(bsym) -> bool:
    return _id(bsym) == prims.PrimIDs.UNPACK_ATTR


def is_unpack_getitem(bsym) -> bool:
    return _id(bsym) == prims.PrimIDs.UNPACK_GETITEM


# a prologue's checks of the values the interpreter read (numbers, strings, None, lengths, types)
_VALUE_CHECKS = frozenset(
    {
        prims.PrimIDs.CHECK_NUMBER_TYPE_AND_VALUE,
        prims.PrimIDs.CHECK_STRING_VALUE,
        prims.PrimIDs.CHECK_NONE,
        prims.PrimIDs.CHECK_LEN,
        prims.PrimIDs.CHECK_LITERAL_LIKE,
        prims.PrimIDs.CHECK_TYPE,
        prims.PrimIDs.CHECK_INSTANCE,
        prims.PrimIDs.CHECK_SLICE_VALUE,
        prims.PrimIDs.CHECK_BOOL_CONVERSION,
        prims.PrimIDs.CHECK_EMPTY,
        prims.PrimIDs.CHECK_TENSOR_SHAPE_AND_METADATA,
    }
)


def is_prologue_value_check(bsym) -> bool:
    """A prologue's check of a value the interpreter read (a number, string, None, length, type or tensor's metadata)."""
    return _id(bsym) in _VALUE_CHECKS


_INPUT_UNPACKING = frozenset(
    {
        prims.PrimIDs.COMMENT,
        prims.PrimIDs.UNPACK_TRIVIAL,
        prims.PrimIDs.UNPACK_SEQUENCE,
        prims.PrimIDs.UNPACK_KEY,
        prims.PrimIDs.UNPACK_EMPTY_DICT,
    }
)


_BOOKKEEPING = _INPUT_UNPACKING | {
    prims.PrimIDs.DEL,
    prims.PrimIDs.RETURN,
    "clear_mutable_collection",
    "shallow_copy",
    # the per-step agreement's host-side exchange around the first collective: no device work
    EXCHANGE_STEP_DIGEST,
    AWAIT_STEP_DIGESTS,
}


def is_input_unpacking(bsym) -> bool:
    """The lines a trace opens with: naming its inputs."""
    return _id(bsym) in _INPUT_UNPACKING


def is_step_check(bsym) -> bool:
    """``check_same_collectives``: the per-step check that every rank issues the same collectives."""
    return _id(bsym) == CHECK_SAME_COLLECTIVES


def is_del(bsym) -> bool:
    """``del``: the end of some names' lifetimes."""
    return _id(bsym) == prims.PrimIDs.DEL


def is_finite_check(bsym) -> bool:
    """One of ``FSDP(check_finite=True)``'s ops: clear the step's flags, check tensors, or decide at the end."""
    return _id(bsym) in (CLEAR_FINITE_FLAGS, CHECK_FINITE, RAISE_IF_NONFINITE)


def is_bookkeeping(bsym) -> bool:
    """Lines that manage names and lifetimes (unpacking, ``del``, return), not device work."""
    return _id(bsym) in _BOOKKEEPING


# shape ops, as Thunder's core and torch executor name them
_GETITEM = frozenset({"getitem", "__getitem__"})
_RESHAPE = frozenset({prims.PrimIDs.RESHAPE, "reshape", "torch_prims_reshape_impl"})
_SLICE = _GETITEM | {prims.PrimIDs.SLICE, "torch_slice_prim_impl"}
# ops whose result shares (or only re-lays out) its input's memory
_VIEW_LIKE = (
    _RESHAPE
    | _SLICE
    | {
        prims.PrimIDs.BROADCAST_IN_DIM,
        prims.PrimIDs.TRANSPOSE,
        prims.PrimIDs.SQUEEZE,
        "split",
        "expand",
        "unsqueeze",
        "squeeze",
        "permute",
        "transpose",
        "view",
        "torch_broadcast_in_dim_prim_impl",
        "torch_transpose_prim_impl",
    }
)


# the same at the functional trace's level, where ops are Thunder's torch symbols: those that return views, and
# reshapes and flattens (views of what is contiguous)
_TORCH_VIEWS = frozenset(s.id for s in ltorch._syms_returning_views | {ltorch.reshape, ltorch.flatten})


def is_torch_view(bsym) -> bool:
    """A Thunder torch symbol (the functional trace's ops) that returns a view of its input, or a reshape."""
    return _id(bsym) in _TORCH_VIEWS


def is_getitem(bsym) -> bool:
    return _id(bsym) in _GETITEM


def is_reshape(bsym) -> bool:
    return _id(bsym) in _RESHAPE


def is_slice(bsym) -> bool:
    """``getitem`` or the slice prim: a sub-range of its input."""
    return _id(bsym) in _SLICE


def is_view_like(bsym) -> bool:
    """A view or re-layout of its input: what cuts gathered parameters out of an all-gather's buffer."""
    return _id(bsym) in _VIEW_LIKE


_DIVISION = frozenset({"true_divide", "div", prims.PrimIDs.DIV})

# what builds a collective's send buffer: the shapes above, and these copies and scalings
_PACKING = _DIVISION | frozenset(
    {
        "cat",
        prims.PrimIDs.CAT,
        "pad",
        prims.PrimIDs.PAD,
        "torch_pad_prim_impl",
        "to",
        "convert_element_type",
        prims.PrimIDs.CONVERT_ELEMENT_TYPE,
        "torch_convert_element_type_prim_impl",
    }
)


_CONVERSION = frozenset(
    {
        "to",
        "convert_element_type",
        prims.PrimIDs.CONVERT_ELEMENT_TYPE,
        "torch_convert_element_type_prim_impl",
        prims.PrimIDs.DEVICE_PUT,
        "torch_device_put_prim_impl",
    }
)


def is_conversion(bsym) -> bool:
    """A cast to another dtype or a copy to another (or the same) device: mixed precision and offload."""
    return _id(bsym) in _CONVERSION


def is_division(bsym) -> bool:
    """A division (how gradients are averaged over ranks before their reduce-scatter)."""
    return _id(bsym) in _DIVISION


def is_packing(bsym) -> bool:
    """A shape op, concatenation, padding, division or cast, or one of the pass's pack and unpack ops: how a
    collective's flat buffer is built, and taken apart."""
    return is_view_like(bsym) or _id(bsym) in _PACKING or _id(bsym) in _BUFFER_OPS


def collectives(trace) -> list:
    """The collective bound symbols of ``trace`` in program order (top level only)."""
    return [b for b in trace.bound_symbols if is_collective(b)]


# the ops selective activation checkpointing keeps the results of (plan.checkpointing): matmuls and attentions, as
# the functional forward trace names them (Thunder's torch language) and as its prims do
_MATMUL = frozenset(
    {
        "torch.nn.functional.linear",
        "torch.matmul",
        "torch.bmm",
        "torch.baddbmm",
        "torch.nn.functional.scaled_dot_product_attention",
        prims.PrimIDs.LINEAR,
        prims.PrimIDs.MATMUL,
    }
)


def is_matmul(bsym) -> bool:
    """A matmul, a linear or an attention: what selective checkpointing keeps the results of."""
    return _id(bsym) in _MATMUL
