"""Pass: place every collective's issue and wait so that communication overlaps compute.

``schedule_collectives(trace, schedule) -> trace``, on a final (executable) forward or backward trace.

Invariants: the compute ops keep their order; only collectives, their waits and the packing ops that
feed nothing but a collective move; the result depends on the trace alone (no rank, no timing), so
every rank, and every recompile, issues the same collectives in the same order.

1. Drop the trace's ``del`` and ``clear_mutable_collection`` lines (step 6 writes them again).
2. Waits: each wait, with the shape ops that only cut its result into pieces, sits right before the
   first other op that reads any of it.
3. All-gathers, in the order of their first use: gather ``k`` is issued right after the wait of gather
   ``k - prefetch``, i.e. while the unit before it computes; the first ``prefetch`` ones at the top of the
   forward (little is live there, and they overlap whatever precedes the first unit), and in the backward
   right before the first op that computes with gathered parameters (those the trace receives, the units
   the forward kept gathered, or its own gathers' results): the ops above it belong to no unit (the loss's
   gradient) and hold the step's largest activations, so a gather issued there would hold its buffer at
   the step's peak and overlap none of a unit's compute;
   ``prefetch`` is the depth of the gather's unit (``Schedule.prefetch_of``; the units are read off the ops
   feeding the gathers, ``unit_of``), 0 issues it right before its own wait; over a group of one rank every
   gather's depth is 0 (it moves nothing, so prefetching it would only hold its buffer longer).
   If the gathered bytes issued but not used yet would exceed ``max_unused_bytes``, it is issued after
   a later wait instead (never later than the wait before its own). Exception: the leading gathers
   whose units stay gathered for the backward (``kept``; all of them under ZeRO-2) are all issued at
   the top: their memory is held until the backward anyway, and nothing they queue behind is needed
   sooner.
4. Reduce-scatters (and all-reduces) are issued as soon as their input is computed; their waits, by
   step 2, sit just before the first use of their result (the backward's end at the latest), but no
   more than ``reduce_scatters_in_flight`` of a kind are outstanding: reduce-scatter ``k`` is waited before
   ``k + reduce_scatters_in_flight`` is issued (each one keeps its full-size input alive until then).
   HSDP: a reduce-scatter whose result an all-reduce sums over the replicas is waited right before the next
   reduce-scatter is issued (after the next unit's gradients are computed), and its all-reduce issued right
   then: the reduce-scatter overlaps the next unit's backward, the all-reduce the one after.
5. The packing ops that feed only a collective (reshapes, ``cat``, ``pad``, casts) move with
   it, so a prefetched gather's send buffer is not built long before it is sent.
6. A priority topological sort puts it together (a key per op: its old position, or the position it
   was given above; a second sort applies the reduce-scatter bound to the positions of the first),
   then Thunder's ``del_last_used`` frees each tensor after its new last use.
"""

from __future__ import annotations

import heapq
import math

from thunder.core import prims
from thunder.core.trace import TraceProvenance, from_trace
from thunder.executors.passes import del_last_used
from thunder.executors.pythonex import clear_mutable_collection

from fsdp_pass.passes.collective_groups import first_reader, graph, packing_group, unpacking_group
from fsdp_pass.predicates import (
    collective_group,
    is_all_gather,
    is_all_reduce,
    is_bookkeeping,
    is_collective,
    is_packing,
    is_reduce_scatter,
    is_return,
    is_wait,
)
from fsdp_pass.plan.schedule import Schedule

_EARLIEST = -math.inf


def _without_lifetimes(bsyms):
    return [b for b in bsyms if b.sym.id != prims.PrimIDs.DEL and b.sym is not clear_mutable_collection]


def _nbytes(proxy) -> int:
    return proxy.numel * proxy.dtype.bytes


def _gather_issue_keys(wait_key, sizes, depths, schedule: Schedule, leading_kept: int, first_unit_op) -> list[tuple]:
    """Step 3: the sort key of each gather's issue (gathers in order of first use, ``depths`` their prefetch;
    ``first_unit_op``: the position of the first op computing with gathered parameters, None: the top)."""
    keys = []
    for k in range(len(sizes)):
        if k < leading_kept:
            keys.append((_EARLIEST, k))  # kept for the backward anyway: no memory saved by waiting
            continue
        if depths[k] == 0:
            keys.append((wait_key[k][0] - 0.25, k))  # just before its own wait
            continue
        j = k - depths[k]  # issue right after the wait of gather j (j < 0: at the top)
        limit = schedule.max_unused_bytes
        while limit is not None and j < k - 1 and sum(sizes[max(j + 1, 0) : k + 1]) > limit:
            j += 1
        if j >= 0:
            at = wait_key[j][0] + 0.25
        else:
            at = _EARLIEST if first_unit_op is None else min(first_unit_op, wait_key[k][0]) - 0.25
        keys.append((at, k))
    return keys


def _prefetch(gather, schedule: Schedule, unit_of) -> int:
    """The gather's prefetch depth: its unit's, or 0 over a group of one rank, where the gather moves nothing (it
    returns the packed shards) and there is nothing to overlap: its buffer is then packed right before its use."""
    if collective_group(gather).size() == 1:
        return 0
    return schedule.prefetch_of(unit_of.get(gather.output.name))


def schedule_collectives(
    trace, schedule: Schedule, kept: frozenset[str] = frozenset(), unit_of=None, received: frozenset[str] = frozenset(),
    backward: bool = False,
):
    """``kept``: output names of the all-gathers whose units stay gathered for the backward; ``unit_of``: output
    name of a collective -> its unit's name (for ``Schedule.prefetch_by_unit``); ``received``: names of gathered
    parameters the trace receives (the backward: those of the units the forward kept gathered,
    :func:`~fsdp_pass.passes.collective_groups.gathered_parameters` of the final forward); ``backward``: the trace
    is a backward (its first gathers wait for its first unit's op, see step 3)."""
    unit_of = unit_of or {}
    bsyms = _without_lifetimes(trace.bound_symbols)
    had_clears = any(b.sym is clear_mutable_collection for b in trace.bound_symbols)  # a backward trace
    producer, consumers = graph(bsyms)
    (ret,) = [i for i, b in enumerate(bsyms) if is_return(b)]
    key = [(float(i), 0) for i in range(len(bsyms))]  # (position, order among ops placed at one position)

    # 2. waits (and the ops cutting up their result) right before the first other use of it
    wait_group, use_order = _place_waits(bsyms, consumers, key, ret)
    _wait_chained_before_next_reduction(bsyms, wait_group, producer, key)

    # 3. gathers, in order of use (a weight before the bias the same op reads), after the wait
    #    `prefetch` gathers earlier
    gathers = sorted((c for c in wait_group if is_all_gather(bsyms[c])), key=use_order.__getitem__)
    leading_kept = 0
    if schedule.kept_units_first:
        while leading_kept < len(gathers) and bsyms[gathers[leading_kept]].output.name in kept:
            leading_kept += 1
    wait_keys = [key[wait_group[c][0]] for c in gathers]
    sizes = [_nbytes(bsyms[c].output) for c in gathers]
    depths = [_prefetch(bsyms[c], schedule, unit_of) for c in gathers]
    # the backward's first gathers wait for its first unit's op (above it: the loss's gradient, at the step's
    # peak); the forward's are issued at the top, where little is live, to overlap whatever precedes the first unit
    first_unit_op = (min([use_order[c][0] for c in gathers] + [_first_reader_or_end(bsyms, received, ret)])
                     if backward else None)
    keys = _gather_issue_keys(wait_keys, sizes, depths, schedule, leading_kept, first_unit_op)
    issue_key = dict(zip(gathers, keys))
    # 4. reduce-scatters and all-reduces as soon as their input exists
    issue_key.update({c: (_EARLIEST, 0) for c in wait_group if c not in issue_key})
    # 5. packing ops travel with their collective
    for c, at in issue_key.items():
        for j in packing_group(c, bsyms, producer, consumers):
            key[j] = at

    # 6. priority topological sort; bound the reduce-scatters in flight; dels for the new order
    order = _priority_topological_order(bsyms, producer, key)
    order = _bound_reductions_in_flight(order, bsyms, producer, wait_group, schedule.reduce_scatters_in_flight)
    assert order[-1] == ret, "the return must stay last"
    new = from_trace(trace)
    new.bound_symbols = [bsyms[i] for i in order]
    new = del_last_used(new, clear_mutable_collections=had_clears)
    new.set_provenance(TraceProvenance(f"fsdp_pass: schedule collectives ({schedule})"))
    return new


def _place_waits(bsyms, consumers, key, ret: int):
    """Moves each collective's wait (and the ops cutting up its result) right before the first other use of it, in
    ``key``. Returns collective index -> its wait and the ops cutting up the wait's result, and collective index ->
    (first use, argument position there): the order of use."""
    wait_group, use_order = {}, {}
    for c, b in enumerate(bsyms):
        if is_collective(b):
            (w,) = [j for j in consumers.get(b.output.name, []) if is_wait(bsyms[j])]
            group, readers, made = unpacking_group(w, bsyms, consumers)
            first_use = min(readers, default=ret)
            for j in group:
                key[j] = (first_use - 0.5, 0)
            wait_group[c] = group
            args = [p.name for p in bsyms[first_use].flat_proxy_args]
            use_order[c] = (first_use, min((i for i, n in enumerate(args) if n in made), default=0))
    return wait_group, use_order


def _first_reader_or_end(bsyms, names, end: int) -> int:
    at = first_reader(bsyms, names) if names else None
    return end if at is None else at


def _wait_chained_before_next_reduction(bsyms, wait_group, producer, key) -> None:
    """Step 4, HSDP: a reduction whose result another collective reads (a reduce-scatter summed over the
    replicas by an all-reduce) is waited right before the next reduction that reads no collective's result is
    issued; the collective reading it is issued right after (as soon as its input exists)."""
    waits = {group[0] for group in wait_group.values()}  # a wait group starts with its wait
    fed = {c for c in wait_group if producer.get(bsyms[c].flat_proxy_args[0].name) in waits}
    firsts = sorted(c for c in wait_group if not is_all_gather(bsyms[c]) and c not in fed)
    for k, c in enumerate(firsts[:-1]):
        if any(j in fed for j in _readers_of(bsyms, wait_group[c])):
            for j in wait_group[c]:  # later than step 2 put it: before the reading collective
                key[j] = (firsts[k + 1] - 0.5, 0)


def _readers_of(bsyms, group) -> set[int]:
    made = {o.name for j in group for o in bsyms[j].flat_proxy_outs}
    return {i for i, b in enumerate(bsyms) if i not in group and any(p.name in made for p in b.flat_proxy_args)}


def _bound_reductions_in_flight(order, bsyms, producer, wait_group, limit) -> list[int]:
    """Wait for reduce-scatter ``k`` before reduce-scatter ``k + limit`` is issued (all-reduces likewise).

    A reduce-scatter keeps its full-size input alive until its wait, so without a bound every unit's
    full gradient buffer would live until the backward's end.
    """
    position = {i: p for p, i in enumerate(order)}
    key = [(float(position[i]), 0) for i in range(len(bsyms))]
    moved = False
    for kind in (is_reduce_scatter, is_all_reduce):
        issued = [i for i in order if i in wait_group and kind(bsyms[i])]
        if limit is None or len(issued) <= limit:
            continue
        for k, c in enumerate(issued[:-limit]):
            deadline = position[issued[k + limit]] - 0.5
            for j in wait_group[c]:
                key[j] = min(key[j], (deadline, 0))
        moved = True
    return _priority_topological_order(bsyms, producer, key) if moved else order


def _priority_topological_order(bsyms, producer, key) -> list[int]:
    """Kahn's algorithm taking, among the ops whose inputs are ready, the one with the smallest key.

    A packing or bookkeeping op (argument unpacking, shape ops) first takes the smallest key of what
    reads it (``bsyms`` is in a valid order: its readers come after it), so a collective placed early
    does not wait for the unpacking of its arguments behind other ops. Compute ops keep their keys:
    compute is never moved.
    """
    deps = [{producer[p.name] for p in b.flat_proxy_args if p.name in producer} - {i} for i, b in enumerate(bsyms)]
    users: list[list[int]] = [[] for _ in bsyms]
    for i, ds in enumerate(deps):
        for d in ds:
            users[d].append(i)
    key = list(key)
    for i in reversed(range(len(bsyms))):
        if is_packing(bsyms[i]) or is_bookkeeping(bsyms[i]):
            key[i] = min([key[i], *(key[u] for u in users[i])])
    waiting = [len(ds) for ds in deps]
    ready = [(key[i], i) for i in range(len(bsyms)) if not waiting[i]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, i = heapq.heappop(ready)
        order.append(i)
        for u in users[i]:
            waiting[u] -= 1
            if not waiting[u]:
                heapq.heappush(ready, (key[u], u))
    assert len(order) == len(bsyms), "the trace has a dependency cycle"
    return order
