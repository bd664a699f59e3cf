"""Measure what a real step allocates, to hold :mod:`fsdp_pass.memory`'s prediction against.

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

import warnings
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile


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


def _peak(events) -> tuple[int, int]:
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, live


def allocated_during(fn, device: str | torch.device = "cpu") -> Allocations:
    """What ``fn()`` allocates on ``device``: the step's tensors, and the process group's scratch."""
    from torch._C._profiler import _EventType  # the allocation events of the profiler's event tree

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
        (group if inside else step).append((n.start_time_ns, fields.alloc_size))
    peak, net = _peak(step)
    group_peak, _ = _peak(group)
    return Allocations(peak, net, group_peak)
