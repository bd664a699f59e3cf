"""Measure what a real step allocates and communicates, to hold :func:`fsdp_pass.explain`'s predictions against.

``CollectiveBytes()``: a context that records the full buffer of every all-gather and reduce-scatter
handed to ``torch.distributed`` while it is open, and the bytes each rank sends for them (ring model).

``allocated_during(fn) -> Allocations``: run ``fn()`` under torch's profiler with memory profiling on
and replay every allocation and free of the window in time order. It sees every tensor allocation of
the device's allocator (on CPU too, where torch keeps no memory statistics), including scratch memory
inside ops that no trace shows.

Allocations made inside the process group's own calls (profiler ops named ``c10d::...`` or
``gloo:...``) are counted apart: gloo copies each collective's full buffer into scratch memory, on the
calling thread or its worker thread, and frees it when the collective completes, a moment that depends
on timing. NCCL allocates no such tensors. A block belongs to whoever allocated it, whoever frees it.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile


class CollectiveBytes:
    """Records ``(kind, full buffer bytes)`` of each all-gather / reduce-scatter issued inside the block."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    @property
    def bytes_sent_per_rank(self) -> float:
        """Ring model: a collective over a full buffer of S bytes sends (N-1)/N * S from each rank."""
        n = dist.get_world_size()
        return sum(b for _, b in self.calls) * (n - 1) / n

    def __enter__(self):
        self._saved = dist.all_gather_into_tensor, dist.reduce_scatter_tensor
        gather, scatter = self._saved

        def all_gather_into_tensor(out, inp, *args, **kwargs):
            self.calls.append(("all_gather", out.numel() * out.element_size()))
            return gather(out, inp, *args, **kwargs)

        def reduce_scatter_tensor(out, inp, *args, **kwargs):
            self.calls.append(("reduce_scatter", inp.numel() * inp.element_size()))
            return scatter(out, inp, *args, **kwargs)

        dist.all_gather_into_tensor, dist.reduce_scatter_tensor = all_gather_into_tensor, reduce_scatter_tensor
        return self

    def __exit__(self, *exc):
        dist.all_gather_into_tensor, dist.reduce_scatter_tensor = self._saved


@dataclass(frozen=True)
class Allocations:
    peak_bytes: int  # tensors of the step: highest point above the start of the window
    net_bytes: int  # tensors of the step still live at the end of the window
    process_group_peak_bytes: int  # allocated inside process-group calls, highest point


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
    from torch._C._profiler import _EventType  # the allocation events of the profiler's event tree

    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # read once, at the profiler's first start: errors only
    device = torch.device(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=activities, profile_memory=True) as prof:
            fn()
    nodes = sorted(
        (
            n
            for n in _walk(prof.profiler.kineto_results.experimental_event_tree())
            if n.typed[0] == _EventType.Allocation and n.typed[1].device.type == device.type
        ),
        key=lambda n: n.start_time_ns,
    )
    by_group: dict[int, bool] = {}  # live pointer -> allocated inside a process-group call
    step, group = [], []
    for n in nodes:
        fields = n.typed[1]
        if fields.alloc_size > 0:
            by_group[fields.ptr] = _inside_process_group(n)
            inside = by_group[fields.ptr]
        else:  # a free: of a block allocated in the window, or of one from before it
            inside = by_group.pop(fields.ptr, _inside_process_group(n))
        (group if inside else step).append(fields.alloc_size)
    peak, net = _peak(step)
    group_peak, _ = _peak(group)
    return Allocations(peak, net, group_peak)
