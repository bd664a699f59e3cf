"""Measure what a real step allocates and communicates, to hold :func:`fsdp_pass.report.explain`'s predictions against.

``CollectiveBytes()``: a context that records the full buffer of every all-gather and reduce-scatter
issued while it is open (by ``fsdp_comm``, a one-rank group's included, which call no backend, or by other code through
``torch.distributed``) (and of every all-reduce of floating-point values: HSDP's
gradient shards; the per-step check's integer all-reduce is not the step's data), and the bytes each rank
sends for them (ring model, over each call's group).

``allocated_during(fn) -> Allocations``: run ``fn()`` under torch's profiler with memory profiling on
and replay every allocation and free of the window in time order. It sees every tensor allocation of
the device's allocator (on CPU too, where torch keeps no memory statistics), including scratch memory
inside ops that no trace shows. Its peak comes twice: as the profiler recorded the events
(``recorded_peak_bytes``) and with the frees it lost put back (``peak_bytes``, below).

Allocations made inside the process group's own calls (profiler ops named ``c10d::...`` or
``gloo:...``) are counted apart: gloo copies each collective's full buffer into scratch memory, on the
calling thread or its worker thread, and frees it when the collective completes, a moment that depends
on timing. NCCL allocates no such tensors. A block belongs to whoever allocated it, whoever frees it.

Frees the profiler loses: a gloo work holds its input and output tensors, and when its worker thread
drops the work after the calling thread has dropped every other reference, the tensor is freed on the
worker thread outside the work's profiling context, and no free is recorded. ``allocated_during``
therefore marks the end of each collective's wait in the profile (``fsdp_measure::waited N``) and
notes the collective's buffers; a buffer whose free is missing is freed at its collective's wait,
where the worker lets go of it (a few microseconds later in fact). Without this, a step measures one
or more send buffers too many, at random.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from fsdp_pass_executors.collectives import watching_issues
from torch._C._profiler import _EventType  # the allocation events of the profiler's event tree
from torch.profiler import ProfilerActivity, profile

from fsdp_pass.op_names import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER


class CollectiveBytes:
    """Records ``(kind, full buffer bytes)`` of each collective issued inside the block (``calls``), and the size
    of the group each ran on (``group_sizes``)."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self.group_sizes: list[int] = []

    @property
    def bytes_sent_per_rank(self) -> float:
        """Ring model: over a group of N ranks, a gather or reduce-scatter of a full buffer of S bytes sends
        (N-1)/N * S from each rank, an all-reduce twice that."""
        total = 0.0
        for (kind, size), n in zip(self.calls, self.group_sizes):
            total += size * (n - 1) / n * (2 if kind is ALL_REDUCE else 1)
        return total

    def __enter__(self):
        def record(kind, out, inp, group, call):
            self.calls.append((kind, (out if kind is ALL_GATHER else inp).nbytes))
            self.group_sizes.append(dist.get_world_size(group))
            return call()

        self._intercept = _InterceptCollectives(record).__enter__()
        return self

    def __exit__(self, *exc):
        self._intercept.__exit__(*exc)


class _InterceptCollectives:
    """While open, every collective goes through ``around(kind, out, inp, group, call)``, which must return
    ``call()``'s result (an all-reduce's ``out`` and ``inp`` are its one tensor): the all-gathers, reduce-scatters
    and all-reduces of floating-point tensors that ``fsdp_comm`` issues, seen by its one issue hook
    (:func:`fsdp_pass_executors.collectives.watching_issues`: backend calls and one-rank collectives alike), and those
    that other code hands to ``torch.distributed`` itself (FSDP2 and DDP in the benchmarks), seen by wrapping
    ``dist.all_gather_into_tensor`` / ``dist.reduce_scatter_tensor`` / ``dist.all_reduce``. A collective that
    ``fsdp_comm`` issues through ``torch.distributed`` is seen once, by the hook."""

    def __init__(self, around):
        self.around = around
        self._issuing = False  # inside fsdp_comm's issue: its backend call was seen by the hook already

    def __enter__(self):
        self._saved = dist.all_gather_into_tensor, dist.reduce_scatter_tensor, dist.all_reduce
        dist.all_gather_into_tensor, dist.reduce_scatter_tensor, dist.all_reduce = (
            self._wrapped(kind, f) for kind, f in zip((ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE), self._saved)
        )
        self._hook = watching_issues(self._issued)
        self._hook.__enter__()
        return self

    def _seen(self, kind, out, inp, group, call):
        if kind is ALL_REDUCE and not out.is_floating_point():  # the per-step check's digest: not the step's data
            return call()
        return self.around(kind, out, inp, group, call)

    def _issued(self, kind, out, inp, group, call):
        self._issuing = True
        try:
            return self._seen(kind, out, inp, group, call)
        finally:
            self._issuing = False

    def _wrapped(self, kind, collective):
        signature = inspect.signature(collective)

        @functools.wraps(collective)  # so that a second interception reads the same signature
        def wrapper(*args, **kwargs):  # callers name the tensors (FSDP2: output=, input=) or not
            call = functools.partial(collective, *args, **kwargs)
            if self._issuing:
                return call()
            bound = signature.bind(*args, **kwargs).arguments
            tensors = [bound["tensor"]] * 2 if kind is ALL_REDUCE else list(bound.values())[:2]
            return self._seen(kind, *tensors, bound.get("group"), call)

        return wrapper

    def __exit__(self, *exc):
        self._hook.__exit__(*exc)
        dist.all_gather_into_tensor, dist.reduce_scatter_tensor, dist.all_reduce = self._saved


_ISSUED, _WAITED = "fsdp_measure::issued ", "fsdp_measure::waited "
_MARKS = (_ISSUED, _WAITED)


class _WaitMarkedWork(dist.Work):
    """A collective's work whose ``wait()`` leaves a ``fsdp_measure::waited N`` event in the profile.
    A ``Work`` itself, as callers (FSDP2) check ``isinstance(work, Work)`` before they wait."""

    def __init__(self, work, index: int):
        super().__init__()
        self._work, self._index = work, index

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        _mark(_WAITED, self._index)
        return result

    def is_completed(self):
        return self._work.is_completed()

    def get_future(self):
        return self._work.get_future()


def _mark(what: str, index: int) -> None:
    with torch.profiler.record_function(f"{what}{index}"):
        pass


class _CollectiveBuffers:
    """Notes each collective's memory blocks: their addresses, and weak references to their storages
    that tell, after the window, whether they are gone (the tensors' lifetimes stay as they are)."""

    def __init__(self):
        self.blocks: list[list[tuple[int, weakref.ref]]] = []  # collective N -> [(address, storage)]

    def __call__(self, kind, out, inp, group, call):
        index = len(self.blocks)
        self.blocks.append([(t.untyped_storage().data_ptr(), weakref.ref(t.untyped_storage())) for t in (out, inp)])
        _mark(_ISSUED, index)
        work = call()
        if work is None:  # a blocking call: waited on already
            _mark(_WAITED, index)
            return None
        return _WaitMarkedWork(work, index)

    def gone(self) -> list[set[int]]:
        """Collective N -> addresses of its buffers freed by now (a worker thread may lag a moment)."""
        if any(ref() is not None for blocks in self.blocks for _, ref in blocks):
            time.sleep(0.05)
        return [{ptr for ptr, ref in blocks if ref() is None} for blocks in self.blocks]


@dataclass(frozen=True)
class Allocations:
    peak_bytes: int  # tensors of the step: highest point above the start of the window, lost frees put back
    net_bytes: int  # tensors of the step still live at the end of the window
    process_group_peak_bytes: int  # allocated inside process-group calls, highest point
    recorded_peak_bytes: int = 0  # tensors of the step: highest point of the events as the profiler recorded them


def _walk(nodes):
    for n in nodes:
        yield n
        yield from _walk(n.children)


_PROCESS_GROUP_OPS = ("c10d::", "gloo:")


def _inside_process_group(node) -> bool:
    p = node.parent
    while p is not None:
        if p.name.startswith(_PROCESS_GROUP_OPS):
            return True
        p = p.parent
    return False


def _peak(alloc_sizes) -> tuple[int, int]:
    """(highest running sum, final sum) of allocation sizes (frees negative), in time order."""
    live = peak = 0
    for nbytes in alloc_sizes:
        live += nbytes
        peak = max(peak, live)
    return peak, live


def allocated_during(fn, device: str | torch.device = "cpu") -> Allocations:
    """What ``fn()`` allocates on ``device``: the step's tensors, and the process group's scratch."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # read once, at the profiler's first start: errors only
    device = torch.device(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    buffers = _CollectiveBuffers()
    with warnings.catch_warnings(), _InterceptCollectives(buffers):
        warnings.simplefilter("ignore")
        with profile(activities=activities, profile_memory=True) as prof:
            fn()
    nodes = sorted(
        (
            n
            for n in _walk(prof.profiler.kineto_results.experimental_event_tree())
            if n.name.startswith(_MARKS)
            or (n.typed[0] == _EventType.Allocation and n.typed[1].device.type == device.type)
        ),
        key=lambda n: n.start_time_ns,
    )
    events = [
        _mark_event(n.name)
        if n.name.startswith(_MARKS)
        else MemoryEvent("memory", n.typed[1].ptr, n.typed[1].alloc_size, _inside_process_group(n))
        for n in nodes
    ]
    step, group = replay(events, [[ptr for ptr, _ in blocks] for blocks in buffers.blocks], buffers.gone())
    peak, net = _peak(step)
    group_peak, _ = _peak(group)
    recorded_peak, _ = _peak(as_recorded(events))
    return Allocations(peak, net, group_peak, recorded_peak)


def as_recorded(events) -> list[int]:
    """The step's allocations and frees (negative) exactly as the profile recorded them, in time order: nothing
    put back, nothing inferred (a block freed where the profiler did not see it stays live to the end). Blocks
    allocated inside process-group calls are left out, as in :func:`replay`."""
    inside: dict[int, bool] = {}  # address -> whether the block live there was allocated inside the group
    step = []
    for e in events:
        if e.kind != "memory":
            continue
        if e.nbytes > 0:
            inside[e.address] = e.inside_group
            in_group = e.inside_group
        else:
            in_group = inside.pop(e.address, e.inside_group)
        if not in_group:
            step.append(e.nbytes)
    return step


def _mark_event(name: str) -> MemoryEvent:
    kind, index = name.removeprefix("fsdp_measure::").split()  # "issued 3" / "waited 3"
    return MemoryEvent(kind, collective=int(index))


@dataclass(frozen=True)
class MemoryEvent:
    """One event of a profile: an allocation (``nbytes`` > 0) or a free (< 0) at ``address``, made inside
    a process-group call or not; or the mark of collective N's issue (``"issued"``) or wait (``"waited"``)."""

    kind: str  # "memory", "issued" or "waited"
    address: int = 0
    nbytes: int = 0
    inside_group: bool = False
    collective: int = -1


def replay(events, collective_blocks, gone) -> tuple[list[int], list[int]]:
    """The allocations and frees (negative) of the step's tensors and of the process group's, in time order,
    with the frees the profiler lost put back.

    ``events``: in time order. ``collective_blocks[N]``: the addresses of collective N's buffers.
    ``gone[N]``: those of them that were freed by the end. A block of collective N is freed at N's wait
    when it was live at N's issue, the profile shows no free of it, and it is gone by the end. A block
    whose address is allocated again was freed before that.
    """
    freed_unseen = _blocks_freed_unseen(events)
    live: dict[int, tuple[int, int, bool]] = {}  # address -> (allocation event index, bytes, inside the group)
    held: dict[int, list[int]] = {}  # collective N -> allocation indices of its buffers, at its issue
    step, group = [], []
    for k, e in enumerate(events):
        if e.kind == "issued":  # the blocks the collective holds until its wait
            held[e.collective] = [live[a][0] for a in collective_blocks[e.collective] if a in live]
        elif e.kind == "waited":  # free those gone by the end whose free the profile does not show
            for a in gone[e.collective]:
                block = live.get(a)
                if block and block[0] in freed_unseen and block[0] in held.get(e.collective, ()):
                    del live[a]
                    (group if block[2] else step).append(-block[1])
        elif e.nbytes > 0:
            if e.address in live:  # the address is taken again: its block was freed, unseen, before
                _, nbytes, inside = live.pop(e.address)
                (group if inside else step).append(-nbytes)
            live[e.address] = (k, e.nbytes, e.inside_group)
            (group if e.inside_group else step).append(e.nbytes)
        else:  # a free: of a block of the window, or of one allocated before it
            inside = live.pop(e.address)[2] if e.address in live else e.inside_group
            (group if inside else step).append(e.nbytes)
    return step, group


def _blocks_freed_unseen(events) -> set[int]:
    """Indices of the allocation events whose block is never seen freed: the next event at its address is
    another allocation, or there is none."""
    last_at: dict[int, int] = {}  # address -> index of the allocation event that holds it
    unseen = set()
    for k, e in enumerate(events):
        if e.kind != "memory":
            continue
        if e.nbytes > 0:
            if e.address in last_at:
                unseen.add(last_at[e.address])
            last_at[e.address] = k
        else:
            last_at.pop(e.address, None)
    return unseen | set(last_at.values())
