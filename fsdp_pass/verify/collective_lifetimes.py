"""Check a final trace: no collective's buffers are used while it is in flight.

``check_collective_lifetimes(trace)``: every collective is waited for exactly once, nothing but its wait
reads what it returns, and nothing writes into the buffers it reads or fills while it is in flight
(between its issue and its wait). Run at every compile, after the scheduling pass.
"""

from __future__ import annotations

from thunder.core import prims

from fsdp_pass.errors import fail
from fsdp_pass.predicates import is_collective, is_view_like, is_wait

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
