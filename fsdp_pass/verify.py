"""Fail loudly instead of hanging or computing garbage: checks on the final traces.

``check_collective_lifetimes(trace)``: every collective is waited for exactly once, nothing but its wait
reads what it returns, and nothing writes into the buffers it reads or fills while it is in flight
(between its issue and its wait). Run at every compile, after the scheduling pass.

``check_same_collectives_on_all_ranks(trace, phase, group)``: every rank must issue the same
collectives in the same order.

At each compile, each rank reduces its final forward (or backward) trace to a fingerprint: the
inputs it was compiled for and its collective sequence (kind, elements, dtype). Ranks exchange
fingerprints (one small object all-gather on the FSDP group) and all raise the same error, naming
the first difference, if any rank disagrees. A rank whose program would issue different
collectives therefore stops at its first call instead of deadlocking in a mismatched collective.
"""

from __future__ import annotations

import torch.distributed as dist
from thunder.core import prims

from fsdp_pass.errors import fail
from fsdp_pass.predicates import (
    is_all_gather,
    is_all_reduce,
    is_collective,
    is_reduce_scatter,
    is_unpack_trivial,
    is_view_like,
    is_wait,
)

_IN_PLACE_COPY = (prims.PrimIDs.COPY_, "copy_")


def _written(bsym):
    """The tensor an in-place op writes into, or None."""
    return bsym.args[1] if bsym.sym.id in _IN_PLACE_COPY else None


def _lifetime_problem(trace) -> str | None:
    bsyms = trace.bound_symbols
    readers_of: dict[str, list[int]] = {}
    for i, x in enumerate(bsyms):
        if x.sym.id != prims.PrimIDs.DEL:
            for p in x.flat_proxy_args:
                readers_of.setdefault(p.name, []).append(i)
    for c, b in enumerate(bsyms):
        if not is_collective(b):
            continue
        future = b.output.name
        readers = readers_of.get(future, [])
        waits = [i for i in readers if is_wait(bsyms[i])]
        if len(waits) != 1 or len(readers) != 1:
            what = f"collective #{c} ({b.sym.name} -> {future})"
            return f"{what} is read by {len(readers)} op(s), {len(waits)} of them waits"
        (w,) = waits
        if w < c:
            return f"collective #{c} ({future}) is waited for at #{w}, before it is issued"
        in_flight = {p.name for p in b.flat_proxy_args}  # its input, and views of it made meanwhile
        for i in range(c + 1, w):
            x = bsyms[i]
            if is_view_like(x) and any(p.name in in_flight for p in x.flat_proxy_args):
                in_flight.update(o.name for o in x.flat_proxy_outs)
            target = _written(x)
            if target is not None and target.name in in_flight:
                return f"op #{i} ({x.sym.name}) writes into {target.name}, the input of collective #{c} still in flight"
    return None


def check_collective_lifetimes(trace) -> None:
    problem = _lifetime_problem(trace)
    if problem is not None:
        fail(
            f"The final trace would use a collective's buffers while it is in flight: {problem}.",
            "This is a bug in fsdp_pass (or in a transform that rewrote the trace after it): please report it "
            "with print(thunder.last_traces(jitted_model)[-1]); FSDP(schedule=None) avoids the scheduling pass.",
        )


def _kind(bsym) -> str:
    if is_all_gather(bsym):
        return "all_gather"
    if is_reduce_scatter(bsym):
        return "reduce_scatter"
    return "all_reduce"


def collective_sequence(trace) -> list[str]:
    out = []
    for b in trace.bound_symbols:
        if is_all_gather(b) or is_reduce_scatter(b) or is_all_reduce(b):
            t = b.flat_proxy_args[0]
            out.append(f"{_kind(b)}({t.numel} x {t.dtype})")
    return out


def input_signature(trace) -> list[str]:
    sig = []
    for b in trace.bound_symbols:
        if is_unpack_trivial(b):
            o = b.output
            shape = getattr(o, "shape", None)
            if shape is not None:
                sig.append(f"{o.name}: {o.dtype} {list(shape)}")
    return sig


def fingerprint(trace, phase: str) -> dict:
    return {"phase": phase, "inputs": input_signature(trace), "collectives": collective_sequence(trace)}


def describe_difference(prints: list[dict]) -> str | None:
    """None when all ranks agree, else a sentence naming the first difference."""
    ref = prints[0]
    for rank, fp in enumerate(prints[1:], start=1):
        if fp == ref:
            continue
        lines = [f"rank 0 and rank {rank} would issue different collectives in the {ref['phase']}."]
        if fp["inputs"] != ref["inputs"]:
            lines.append(f"  rank 0 was compiled for inputs {ref['inputs']}")
            lines.append(f"  rank {rank} was compiled for inputs {fp['inputs']}")
        a, b = ref["collectives"], fp["collectives"]
        for i in range(max(len(a), len(b))):
            ca = a[i] if i < len(a) else "<none>"
            cb = b[i] if i < len(b) else "<none>"
            if ca != cb:
                lines.append(f"  first difference at collective #{i}: rank 0 {ca} vs rank {rank} {cb}")
                break
        lines.append(f"  rank 0 issues {len(a)} collectives, rank {rank} issues {len(b)}.")
        return "\n".join(lines)
    return None


def check_same_collectives_on_all_ranks(trace, phase: str, group) -> None:
    if dist.get_world_size(group) == 1 or dist.get_backend(group) == "fake":
        return
    mine = fingerprint(trace, phase)
    prints: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(prints, mine, group=group)
    diff = describe_difference(prints)
    if diff is not None:
        fail(
            diff,
            "Give every rank inputs of the same shapes and dtypes and the same model and options "
            "(for a ragged last batch: pad it or drop it, e.g. DataLoader(drop_last=True)).",
        )
