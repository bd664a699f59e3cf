"""Pass: label every collective in a final (executable) trace with its FSDP unit and bytes.

``annotate_collectives(trace, plan, found) -> trace``, ``found`` from
:func:`~fsdp_pass.passes.units_of_collectives.units_of_collectives`.

Thunder's lowering replaces our ops with executor calls and drops their comments, so the labels are put
back on the final forward and backward traces. Each collective and its wait get a header line: unit,
kind, parameters, bytes per rank (in the dtype the collective moves). The op that packs the unit's flat
send buffer, its casts and device copies (mixed precision, offload), each op that cuts a parameter out of
a gathered buffer, the division of a reduce-scatter's result by the world size (of its input, in
float16) and the casts and copies of that result get a shorter one naming the unit (and parameter).
"""

from __future__ import annotations

from thunder.core import utils
from thunder.core.proxies import Proxy
from thunder.core.trace import TraceProvenance, from_trace

from fsdp_pass.op_names import ALL_GATHER, REDUCE_SCATTER, CollectiveKind
from fsdp_pass.plan.units import UnitPlan
from fsdp_pass.text import collective_label
from fsdp_pass.predicates import (
    collective_kind,
    is_all_gather,
    is_conversion,
    is_division,
    is_getitem,
    is_packing,
    is_reduce_scatter,
    is_reshape,
    is_view_like,
    is_wait,
)


def _label(plan: UnitPlan, unit, kind: CollectiveKind, itemsize: int) -> str:
    _, shard_numel, padding = plan.unit_numel(unit)
    shard_bytes = shard_numel * itemsize
    return collective_label(unit.name, kind, len(unit.params), shard_bytes, plan.sharding.world_size, padding)


def _packing_headers(trace, found: dict, plan: UnitPlan) -> dict[int, str]:
    """Headers for the ops that build each collective's send buffer: id(bsym) -> header."""
    producers = utils.producers(trace)
    headers = {}
    for bsym in trace.bound_symbols:
        if not (is_all_gather(bsym) or is_reduce_scatter(bsym)) or bsym.output.name not in found:
            continue
        unit, _ = found[bsym.output.name]
        what = "gradient" if is_reduce_scatter(bsym) else "shard"
        op = producers.get(bsym.flat_proxy_args[0], None)
        while op is not None and (is_division(op) or is_conversion(op)):
            if is_division(op):
                headers[id(op)] = (
                    f"[fsdp] unit {unit.name!r}: gradients divided by the world size "
                    f"{plan.sharding.world_size} before the reduce-scatter sums them (float16's range)"
                )
            else:
                headers[id(op)] = _conversion_header(op, unit, f"{what}s", f"before the {collective_kind(bsym)}")
            op = producers.get(op.flat_proxy_args[0], None)
        if op is not None and is_packing(op):
            n = len(unit.params)
            headers[id(op)] = (
                f"[fsdp] unit {unit.name!r}: pack {n} {what}s into one flat buffer"
                if n > 1
                else f"[fsdp] unit {unit.name!r}: flatten the {what}"
            )
    return headers


def _dtype(proxy) -> str:
    return str(proxy.dtype).removeprefix("thunder.dtypes.")


def _conversion_header(op, unit, what: str, when: str) -> str:
    a, out = op.flat_proxy_args[0], op.output
    if a.dtype != out.dtype:
        return f"[fsdp] unit {unit.name!r}: cast the {what} from {_dtype(a)} to {_dtype(out)} {when}"
    return f"[fsdp] unit {unit.name!r}: copy the {what} from {a.device.device_str()} to {out.device.device_str()} {when}"


def _waits(trace, found: dict, kind: CollectiveKind):
    """(wait, unit) for each wait of a collective of ``kind`` in ``found``."""
    for bsym in trace.bound_symbols:
        if is_wait(bsym) and found.get(bsym.args[0].name, (None, ""))[1] == kind:
            yield bsym, found[bsym.args[0].name][0]


def _reduced_shard_headers(trace, found: dict, plan: UnitPlan) -> dict[int, str]:
    """Headers for the division of a reduce-scatter's result by the world size, and its casts and copies
    back to the shards' dtype and device."""
    consumers = utils.consumers(trace)
    headers = {}
    for bsym, unit in _waits(trace, found, REDUCE_SCATTER):
        frontier = [bsym.output]
        while frontier:
            readers = [c for c in consumers.get(frontier.pop(), []) if is_conversion(c) or is_division(c)]
            for c in readers:
                headers[id(c)] = (
                    f"[fsdp] unit {unit.name!r}: divide the gradient shard by the world size "
                    f"{plan.sharding.world_size} (the reduce-scatter summed): the mean over ranks"
                    if is_division(c)
                    else _conversion_header(c, unit, "gradient shard", "for the optimizer")
                )
                frontier.append(c.output)
    return headers


def _unpacking_headers(trace, found: dict, plan: UnitPlan) -> dict[int, str]:
    """Headers for the ops that cut each parameter out of a gathered buffer: id(bsym) -> header."""
    consumers = utils.consumers(trace)
    headers = {}
    for bsym, unit in _waits(trace, found, ALL_GATHER):
        offsets, offset = {}, 0
        for name in unit.params:
            offsets[offset] = name
            offset += plan.sharding.param(name).layout.shard_numel
        for first in consumers.get(bsym.output, []):
            if len(unit.params) == 1 and is_view_like(first):
                headers[id(first)] = f"[fsdp] unit {unit.name!r}: {unit.params[0]} is a view of the gathered buffer"
            elif is_reshape(first):  # the (world size, flat shard) matrix each parameter is a column block of
                for cut in consumers.get(first.output, []):
                    key = cut.args[1] if is_getitem(cut) and isinstance(cut.args[1], tuple) else None
                    if key and len(key) == 2 and isinstance(key[1], slice) and key[1].start in offsets:
                        headers[id(cut)] = f"[fsdp] unit {unit.name!r}: cut out {offsets[key[1].start]}"
    return headers


def annotate_collectives(trace, plan: UnitPlan, found: dict):
    """``found``: what :func:`~fsdp_pass.passes.units_of_collectives.units_of_collectives` returns for ``trace``."""
    headers = {
        b.output.name: _label(plan, *found[b.output.name], b.flat_proxy_args[0].dtype.bytes)
        for b in trace.bound_symbols
        if (is_all_gather(b) or is_reduce_scatter(b)) and b.output.name in found
    }
    if not headers:
        return trace
    op_headers = {
        **_packing_headers(trace, found, plan),
        **_unpacking_headers(trace, found, plan),
        **_reduced_shard_headers(trace, found, plan),
    }
    new = from_trace(trace)
    for bsym in trace.bound_symbols:
        out = bsym.output if isinstance(bsym.output, Proxy) else None
        if out is not None and out.name in headers:
            bsym = bsym.from_bsym(header=headers[out.name])
        elif is_wait(bsym) and bsym.args[0].name in headers:
            bsym = bsym.from_bsym(header=headers[bsym.args[0].name].replace("[fsdp]", "[fsdp] wait:", 1))
        elif id(bsym) in op_headers:
            bsym = bsym.from_bsym(header=op_headers[id(bsym)])
        new.bound_symbols.append(bsym)
    new.set_provenance(TraceProvenance("fsdp_pass: label collectives with their units"))
    return new
