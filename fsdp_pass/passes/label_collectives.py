"""Pass: label every collective in a final (executable) trace, and the ops around it, with its FSDP unit.

``annotate_collectives(trace, plan, found) -> trace``, ``found`` from
:func:`~fsdp_pass.passes.units_of_collectives.units_of_collectives`.

Thunder's lowering replaces our ops with executor calls and drops their comments, so the labels are put
back on the final forward and backward traces, read off the ops themselves (never off positions):

1. each collective and its wait: unit, kind, parameters, bytes per rank in the dtype the collective moves
   (``# [fsdp] unit 'layers.0' all-gather: 9 param(s), 12.1 MiB/rank x 64 = 772.0 MiB``); with HSDP also the
   group it runs on (``reduce-scatter grads over the shard group (64 ranks)``, ``all-reduce grads over the
   replicate group (8 ranks)``);
2. each pack, unpack and accumulation op: what it does for its unit (the unit's name is the op's second
   argument): packing the shards (and casting, copying them), quantizing them and dequantizing what was
   gathered (``MixedPrecision(gather_dtype=...)``: dtypes and bytes), cutting the parameters out (over one rank:
   viewing the shards as the parameters, the gather that gathers nothing), packing the gradients (casting,
   dividing first in float16), dividing, casting and copying the reduced shard back.
"""

from __future__ import annotations

from thunder.core.proxies import Proxy
from thunder.core.trace import TraceProvenance, from_trace

from fsdp_pass.op_names import ALL_GATHER, ALL_REDUCE, CollectiveKind
from fsdp_pass.plan.units import UnitPlan
from fsdp_pass.predicates import (
    collective_group,
    is_collective,
    is_dequantize_gathered,
    is_pack_grads,
    is_pack_shards,
    is_quantize_shard,
    is_unit_op,
    is_unpack_gathered,
    is_unpack_grad_shard,
    is_view_shards,
    is_wait,
    unit_of_op,
)
from fsdp_pass.plan.quantized_layout import quantized_layout
from fsdp_pass.text import collective_label, human_bytes


def _label(plan: UnitPlan, unit, kind: CollectiveKind, bsym, hsdp: bool) -> str:
    """The header of collective ``bsym``: its unit, kind and bytes, read off the op (dtype moved, group size).
    A gather moves every parameter of the unit; a reduction only the gradients of those that require one."""
    specs = [plan.sharding.param(n) for n in unit.params]
    if kind is not ALL_GATHER:
        specs = [s for s in specs if s.requires_grad]
    shard_numel, padding = sum(s.layout.shard_numel for s in specs), sum(s.layout.padding_numel for s in specs)
    sent = bsym.flat_proxy_args[0]
    # an all-gather sends its input as it is (a quantized one: codes and scales); the others, gradients of the shard
    shard_bytes = sent.numel * sent.dtype.bytes if kind is ALL_GATHER else shard_numel * sent.dtype.bytes
    group = None if not hsdp else ("replicate" if kind is ALL_REDUCE else "shard")
    return collective_label(unit.name, kind, len(specs), shard_bytes, collective_group(bsym).size(), padding, group)


def _dtype(dtype) -> str:
    return str(dtype).removeprefix("thunder.dtypes.").rstrip("_")


def _device(device) -> str:
    return device if isinstance(device, str) else device.device_str()


def _pack_shards(args, unit, world_size) -> list[str]:
    shards, _, dtype, device, _ = args
    n = len(shards)
    parts = [f"pack {n} shards into one flat buffer" if n > 1 else "flatten the shard"]
    if dtype is not None:
        parts.append(f"cast the shards from {_dtype(shards[0].dtype)} to {_dtype(dtype)} before the all-gather")
    if device is not None:
        parts.append(f"copy the shards from {_device(shards[0].device)} to {_device(device)}")
    return parts


def _unpack_gathered(args, unit, world_size) -> list[str]:
    if len(unit.params) == 1:
        return [f"{unit.params[0]} is a view of the gathered buffer"]
    return [f"cut out {', '.join(unit.params)} (one copy out of the gathered buffer, padding rows dropped)"]


def _view_shards(args, unit, world_size) -> list[str]:
    return [f"one rank: {', '.join(unit.params)} {'is a view' if len(unit.params) == 1 else 'are views'} of "
            "this rank's shards, which hold them whole (nothing packed, gathered or copied)"]


def _quantize_shard(args, unit, world_size) -> list[str]:
    shards, _, shapes, world, qdtype, block, device, _ = args
    q = quantized_layout(shapes, world, block)
    read = human_bytes(sum(s.numel * s.dtype.bytes for s in shards))
    aligned = " + alignment" if q.rank_bytes > q.rank_numel + q.scale_bytes else ""
    parts = [
        f"quantize this rank's {len(shards)} shard(s) ({q.rank_numel:,} {_dtype(shards[0].dtype)} elements, {read}) "
        f"to {_dtype(qdtype)} codes with a float32 scale per {block} elements, into its slice of the gathered buffer "
        f"({world} x {human_bytes(q.rank_bytes)}, allocated here; the all-gather fills it in place): "
        f"{human_bytes(q.rank_bytes)}/rank sent ({q.rank_numel:,} B of codes + {q.scale_bytes:,} B of {q.n_blocks:,} "
        f"scales{aligned}, {q.rank_bytes / q.rank_numel:.3f} B an element)"
    ]
    if device is not None:
        parts.append(f"the shards copied from {_device(shards[0].device)} to {_device(device)} a chunk at a time, "
                     f"in {_dtype(shards[0].dtype)}")
    return parts


def _dequantize_gathered(args, unit, world_size) -> list[str]:
    gathered, _, shapes, world, qdtype, block, dtype = args
    q = quantized_layout(shapes, world, block)
    return [
        f"dequantize the gathered {_dtype(qdtype)} codes ({world} ranks x {human_bytes(q.rank_bytes)}, scales "
        f"included) into {_dtype(dtype)}: each code times its block's scale, {world * q.rank_numel:,} elements "
        f"({human_bytes(world * q.rank_numel * dtype.bytes)} held from here, the codes freed after it)"
    ]


def _ranks_summed(ranks: int, world_size: int) -> str:
    """``"world size 64"``; with HSDP ``"512 ranks (64 per shard group x 8 replicas)"``."""
    if ranks == world_size:
        return f"world size {world_size}"
    return f"{ranks} ranks ({world_size} per shard group x {ranks // world_size} replicas)"


def _pack_grads(args, unit, world_size) -> list[str]:
    grads, _, _, _, dtype, divide_first = args
    n = len(grads)
    parts = [f"pack {n} gradients into one flat buffer" if n > 1 else "flatten the gradient"]
    if dtype is not None and dtype != grads[0].dtype:
        parts.append(f"cast the gradients from {_dtype(grads[0].dtype)} to {_dtype(dtype)} before the reduce-scatter")
    if divide_first is not None:
        parts.append(f"gradients divided by the {_ranks_summed(divide_first, world_size)} before the reduce-scatter "
                     "sums them (float16's range)")
    return parts


def _unpack_grad_shard(args, unit, world_size) -> list[str]:
    local, _, shapes, ranks, divide, dtype, device = args
    parts = []
    if divide:
        summed = "the reduce-scatter summed" if ranks == world_size else "the reduce-scatter and all-reduce summed"
        parts.append(f"divide the gradient shard by the {_ranks_summed(ranks, world_size)} ({summed}): "
                     "the mean over ranks")
    if dtype is not None:
        parts.append(f"cast the gradient shard from {_dtype(local.dtype)} to {_dtype(dtype)} for the optimizer")
    if device is not None:
        parts.append(f"copy the gradient shard from {_device(local.device)} to {_device(device)} for the optimizer")
    parts.append(f"cut out the {len(shapes)} shard gradient(s)")
    return parts


def _unit_op_header(bsym, unit, world_size: int) -> str:
    """What one of the pass's pack, unpack or accumulation ops does for ``unit``."""
    for matches, describe in (
        (is_pack_shards, _pack_shards),
        (is_unpack_gathered, _unpack_gathered),
        (is_view_shards, _view_shards),
        (is_quantize_shard, _quantize_shard),
        (is_dequantize_gathered, _dequantize_gathered),
        (is_pack_grads, _pack_grads),
        (is_unpack_grad_shard, _unpack_grad_shard),
    ):
        if matches(bsym):
            return f"[fsdp] unit {unit.name!r}: " + "; ".join(describe(bsym.args, unit, world_size))
    output = bsym.output if isinstance(bsym.output, Proxy) else None
    what = "add the gradients accumulated under no_sync (and empty them)" if output is not None else (
        "no_sync: add the unsharded gradients to its accumulator")
    return f"[fsdp] unit {unit.name!r}: {what}"


def annotate_collectives(trace, plan: UnitPlan, found: dict):
    """``found``: what :func:`~fsdp_pass.passes.units_of_collectives.units_of_collectives` returns for ``trace``."""
    hsdp = any(kind is ALL_REDUCE for _, kind in found.values())  # two groups: say which one each runs on
    headers = {
        b.output.name: _label(plan, *found[b.output.name], b, hsdp)
        for b in trace.bound_symbols
        if is_collective(b) and b.output.name in found
    }
    world_size = plan.sharding.world_size
    unit_named = plan.unit_named
    new = from_trace(trace)
    for bsym in trace.bound_symbols:
        out = bsym.output if isinstance(bsym.output, Proxy) else None
        if is_collective(bsym) and out is not None and out.name in headers:
            bsym = bsym.from_bsym(header=headers[out.name])
        elif is_wait(bsym) and bsym.args[0].name in headers:
            bsym = bsym.from_bsym(header=headers[bsym.args[0].name].replace("[fsdp]", "[fsdp] wait:", 1))
        elif is_unit_op(bsym) and unit_of_op(bsym) in unit_named:
            bsym = bsym.from_bsym(header=_unit_op_header(bsym, unit_named[unit_of_op(bsym)], world_size))
        new.bound_symbols.append(bsym)
    new.set_provenance(TraceProvenance("fsdp_pass: label collectives with their units"))
    return new
