"""How much of the communication kernels' time ran while a compute kernel ran too (a profiled CUDA step).

``kernel_overlap(kernels) -> KernelOverlap``: ``kernels`` are ``(name, start, end)`` of the device's
kernels (any time unit). A kernel is *communication* when its name says NCCL (``ncclDevKernel_...``,
``ncclKernel_...``), else compute. The overlapped time of a communication kernel is the part of its
interval covered by the union of the compute kernels' intervals, so two compute kernels running at once
are not counted twice. The figure: overlapped communication time / all communication time.

``cuda_kernels(prof)``: the kernels of a ``torch.profiler.profile`` with CUDA activity, in microseconds.
gloo runs collectives on the host (no kernels): a gloo step has no figure.
"""

from __future__ import annotations

from dataclasses import dataclass

_COMMUNICATION = ("nccl",)


def is_communication(kernel_name: str) -> bool:
    return any(word in kernel_name.lower() for word in _COMMUNICATION)


def _union(intervals) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _covered(start: float, end: float, union) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in union)


@dataclass(frozen=True)
class KernelOverlap:
    communication: float  # total time of the communication kernels
    overlapped: float  # of which a compute kernel ran at the same time
    compute: float  # wall time covered by compute kernels
    communication_kernels: int

    @property
    def share(self) -> float | None:
        """Overlapped / all communication time; None when no communication kernel ran."""
        return self.overlapped / self.communication if self.communication > 0 else None


def kernel_overlap(kernels) -> KernelOverlap:
    comm = [(s, e) for name, s, e in kernels if is_communication(name)]
    compute = _union((s, e) for name, s, e in kernels if not is_communication(name))
    return KernelOverlap(
        communication=sum(e - s for s, e in comm),
        overlapped=sum(_covered(s, e, compute) for s, e in comm),
        compute=sum(b - a for a, b in compute),
        communication_kernels=len(comm),
    )


def cuda_kernels(prof) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every CUDA kernel a profile recorded."""
    out = []
    for e in prof.events():
        if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA") and e.time_range:
            out.append((e.name, float(e.time_range.start), float(e.time_range.end)))
    return out
