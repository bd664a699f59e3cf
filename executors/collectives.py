"""``fsdp_comm``: the Thunder executor that runs the pass's collectives on async work handles.

It implements Thunder's distributed prims ``all_gather``, ``reduce_scatter``, ``all_reduce`` (HSDP's sum of a
reduced shard over its replicas) and ``wait``; in a printed execution trace they read ``fsdp_all_gather(...)``,
``fsdp_reduce_scatter(...)``, ``fsdp_all_reduce(...)``, ``fsdp_wait(...)``.

1. Issue (``fsdp_all_gather`` / ``fsdp_reduce_scatter`` / ``fsdp_all_reduce``, through ``_issue``, where
   :func:`watching_issues`' subscribers see it): allocate the output where the
   input lives (an all-reduce asked to skip the clone sums in place; an all-gather of shards packed into
   their slice of the gathered buffer, :data:`GATHERED_BUFFER`, fills that buffer in place), start the collective with
   ``async_op=True`` and return an :class:`InFlight`: the work handle, the output, and the input. The
   trace's ``del`` of the input after the issue then frees nothing: the handle keeps every buffer the
   collective reads or writes alive until its wait.
2. On CUDA the collective is issued on one dedicated communication stream per device, after that
   stream waits for the compute stream (an event between the streams), so the input is complete.
   Both buffers were allocated by the compute stream, and are released only after step 3 made the
   compute stream wait for the collective: the caching allocator cannot hand them to a new tensor
   while the collective still reads or writes them.
3. Wait (``fsdp_wait``): wait on the handle, make the compute stream wait for the communication
   stream (CUDA), drop the input, return the output. The time the host spends blocked in ``wait`` is
   added to :data:`WAIT_CLOCK` (on CUDA the host rarely blocks; the GPU does, and that is not counted).

While :data:`WAIT_CLOCK` records (``reset(record=True)``), each collective also leaves a
:class:`CollectiveEvent`: issued, completed, wait started, wait ended. ``completed`` is stamped by a
callback on the work's future, on the thread that finishes the collective (gloo's own). It is NaN where
the work has no future (gloo's reduce-scatter) and on CUDA, where the host learns nothing about when the
GPU finished.

On CPU/gloo the same path runs: gloo runs collectives on its own threads, so compute continues while
one is in flight. Over a group of one rank (world size 1) an all-gather or a reduce-scatter returns its input (a view:
the gathered buffer is the packed shards, the summed part the packed gradients; the memory model counts by
:func:`fsdp_pass.ops.flat_buffers.collective_returns_input`), an all-reduce sums nothing; no backend call, and the
wait returns at once. ``fsdp_wait`` also accepts the ``(handle, tensor)`` pair of Thunder's torch executor,
for collectives this executor did not issue (e.g. a ``broadcast`` from another transform).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from thunder.distributed import prims as dist_prims
from thunder.extend import OperatorExecutor, register_executor
from thunder.torch import to_torch_distributed_reduce_op
from fsdp_pass.op_names import (
    ALL_GATHER,
    ALL_GATHER_OP,
    ALL_REDUCE,
    ALL_REDUCE_OP,
    COMM_EXECUTOR,
    REDUCE_SCATTER,
    REDUCE_SCATTER_OP,
    WAIT_OP,
    CollectiveKind,
)

comm_ex = OperatorExecutor(COMM_EXECUTOR, version="0.1")
register_executor(comm_ex)


@dataclass(frozen=True)
class CollectiveEvent:
    """One collective as the host saw it (``time.perf_counter()`` seconds)."""

    kind: CollectiveKind
    numel: int  # of the full (unsharded) buffer
    issued: float
    wait_started: float
    wait_ended: float
    completed: float = math.nan  # when the collective finished (its work's future completed); NaN: unknown


class WaitClock:
    """Host seconds spent blocked in ``fsdp_wait``, and how many waits, since the last ``reset()``.

    ``reset(record=True)`` also keeps a :class:`CollectiveEvent` per collective in ``events`` (for a
    timeline of issue, wait and blocked time).
    """

    def __init__(self):
        self.reset()

    def reset(self, record: bool = False) -> None:
        self.seconds = 0.0
        self.waits = 0
        self.events: list[CollectiveEvent] | None = [] if record else None


WAIT_CLOCK = WaitClock()


@dataclass
class InFlight:
    """A started collective: what its wait needs, and the buffers it must keep alive until then."""

    work: object  # torch.distributed Work
    output: torch.Tensor
    input: torch.Tensor | None
    stream: object  # the CUDA stream it runs on, or None
    kind: CollectiveKind | None = None
    issued: float = 0.0  # time.perf_counter() at issue
    completion: object = None  # recording only: a future whose value is the time the collective finished


_comm_streams: dict[torch.device, torch.cuda.Stream] = {}


def communication_stream(device: torch.device):
    """The one stream per CUDA device that this executor issues collectives on."""
    if device not in _comm_streams:
        _comm_streams[device] = torch.cuda.Stream(device=device)
    return _comm_streams[device]


def _stamp_time(_future) -> float:
    return time.perf_counter()


def _completion_of(work):
    """A future that completes with the time ``work`` finished (None if the work has no future)."""
    if not hasattr(work, "get_future"):
        return None
    try:
        return work.get_future().then(_stamp_time)  # captures nothing: the buffers' lifetimes are unchanged
    except (RuntimeError, AttributeError):  # a backend without futures; a one-rank collective (no backend)
        return None


# What watches the collectives this executor issues: functions ``around(kind, out, inp, group, call)`` that
# return ``call()``'s result (the started collective's work; an all-reduce's ``out`` and ``inp`` are its one
# tensor). ``_issue``, the one place this executor starts a collective, calls them for every collective alike: a
# backend call or, over a group of one rank, one that returns its input. ``fsdp_pass.report.measure`` subscribes
# (``watching_issues``) to count and mark them (``CollectiveBytes``, the measured step).
_ISSUE_WATCHERS: list = []


@contextlib.contextmanager
def watching_issues(around):
    """While open, ``around(kind, out, inp, group, call)`` sees every collective this executor issues."""
    _ISSUE_WATCHERS.append(around)
    try:
        yield
    finally:
        _ISSUE_WATCHERS.remove(around)


def _watched(call, kind, output, input, group):
    for around in reversed(_ISSUE_WATCHERS):  # the first subscribed is outermost
        call = functools.partial(around, kind, output, input, group, call)
    return call()


def _issue(start, output: torch.Tensor, input: torch.Tensor, kind: CollectiveKind, group=None) -> InFlight:
    issued = time.perf_counter()
    call = functools.partial(start, output, input)
    if not output.is_cuda:
        work = _watched(call, kind, output, input, group) if _ISSUE_WATCHERS else call()
        completion = _completion_of(work) if WAIT_CLOCK.events is not None else None
        return InFlight(work, output, input, None, kind, issued, completion)
    compute = torch.cuda.current_stream(output.device)
    comm = communication_stream(output.device)
    comm.wait_stream(compute)  # the input is written by the compute stream
    with torch.cuda.stream(comm):
        work = _watched(call, kind, output, input, group) if _ISSUE_WATCHERS else call()
    return InFlight(work, output, input, comm, kind, issued)


def _resized(a: torch.Tensor, group, grow: bool) -> torch.Tensor:
    rows = a.shape[0] * group.size() if grow else a.shape[0] // group.size()
    return torch.empty((rows, *a.shape[1:]), dtype=a.dtype, device=a.device)


# the attribute of a packed buffer (``pack_shards``' result, this rank's slice of the gathered buffer) that holds the
# whole gathered buffer, which its all-gather fills in place
GATHERED_BUFFER = "fsdp_gathered_buffer"


class _Done:
    """The work of a collective over a group of one rank: nothing to wait for."""

    def wait(self) -> bool:
        return True


def _alone(group) -> bool:
    """A group of one rank: gathering or scattering returns the input, reducing it is the input (no backend call,
    no thread hand-off: on a busy host each of those costs more than the op)."""
    return group.size() == 1


def _all_gather_impl(a: torch.Tensor, /, group, do_async, dim: int | None = None):
    if _alone(group):  # the gathered buffer is the packed shards (fsdp_pass.ops.flat_buffers.collective_returns_input)
        return _one_rank(a, ALL_GATHER, group, do_async)
    out = getattr(a, GATHERED_BUFFER, None)
    if out is None or out.numel() != a.numel() * group.size():
        out = _resized(a, group, grow=True)
    else:
        out = out.view((a.shape[0] * group.size(), *a.shape[1:]))
    start = lambda o, i: dist.all_gather_into_tensor(o, i, group, async_op=True)  # noqa: E731
    flight = _issue(start, out, a, ALL_GATHER, group)
    return flight if do_async else _wait_impl(flight)


def _reduce_scatter_impl(a: torch.Tensor, /, op, group, do_async, dim: int | None = None):
    if _alone(group):  # the summed part is the packed gradients (collective_returns_input)
        return _one_rank(a, REDUCE_SCATTER, group, do_async)
    out = _resized(a, group, grow=False)
    reduce_op = to_torch_distributed_reduce_op(op)
    start = lambda o, i: dist.reduce_scatter_tensor(o, i, reduce_op, group, async_op=True)  # noqa: E731
    flight = _issue(start, out, a, REDUCE_SCATTER, group)
    return flight if do_async else _wait_impl(flight)


def _one_rank(a: torch.Tensor, kind, group, do_async):
    """An all-gather or reduce-scatter over a group of one rank: its result is its input (a view), issued and
    waited like any other collective, with no backend call and nothing copied."""
    flight = _issue(lambda o, i: _Done(), a.view(a.shape), a, kind, group)
    return flight if do_async else _wait_impl(flight)


def _all_reduce_impl(a: torch.Tensor, /, op, group, do_async, skip_clone: bool = False):
    out = a if skip_clone else a.clone()
    reduce_op = to_torch_distributed_reduce_op(op)
    start = (lambda o, i: _Done()) if _alone(group) else (  # one rank: the sum is the input
        lambda o, i: dist.all_reduce(o, reduce_op, group, async_op=True)
    )
    flight = _issue(start, out, out, ALL_REDUCE, group)
    return flight if do_async else _wait_impl(flight)


def _wait_impl(flight, /) -> torch.Tensor:
    if isinstance(flight, tuple):  # Thunder's torch executor's future: (work, tensor)
        flight = InFlight(flight[0], flight[1], None, None)
    t0 = time.perf_counter()
    flight.work.wait()
    if flight.stream is not None:
        torch.cuda.current_stream(flight.output.device).wait_stream(flight.stream)
    t1 = time.perf_counter()
    WAIT_CLOCK.seconds += t1 - t0
    WAIT_CLOCK.waits += 1
    if WAIT_CLOCK.events is not None:
        numel = flight.input.numel() if flight.kind is REDUCE_SCATTER else flight.output.numel()
        WAIT_CLOCK.events.append(CollectiveEvent(flight.kind, numel, flight.issued, t0, t1, _completed_at(flight)))
    flight.input = None  # released only now that the compute stream is ordered after the collective
    flight.completion = None
    return flight.output


def _completed_at(flight: InFlight) -> float:
    if flight.completion is None:
        return math.nan
    # the work is done; its callback may still be on its way (it runs after the work is marked done)
    return flight.completion.wait()


# torch's ``*_into_tensor`` collectives work along dim 0; other dims stay with Thunder's torch executor
def _gathers_dim0(a, /, group, do_async, dim=None) -> bool:
    return dim in (None, 0)


def _scatters_dim0(a, /, op, group, do_async, dim=None) -> bool:
    return dim in (None, 0)


all_gather_impl = comm_ex.register_operator(ALL_GATHER_OP, meta=dist_prims.all_gather.meta, fn=_all_gather_impl)
reduce_scatter_impl = comm_ex.register_operator(
    REDUCE_SCATTER_OP, meta=dist_prims.reduce_scatter.meta, fn=_reduce_scatter_impl
)
all_reduce_impl = comm_ex.register_operator(ALL_REDUCE_OP, meta=dist_prims.all_reduce.meta, fn=_all_reduce_impl)
wait_impl = comm_ex.register_operator(WAIT_OP, meta=dist_prims.wait.meta, fn=_wait_impl)

comm_ex.register_implementation(dist_prims.all_gather, all_gather_impl, checker=_gathers_dim0)
comm_ex.register_implementation(dist_prims.reduce_scatter, reduce_scatter_impl, checker=_scatters_dim0)
comm_ex.register_implementation(dist_prims.all_reduce, all_reduce_impl)
comm_ex.register_implementation(dist_prims.wait, wait_impl)
