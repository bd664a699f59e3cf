"""Count the collectives one training step issues, and the bytes each rank sends, for any system.

Method: run the step under ``torch.profiler`` (CPU activity, ``record_shapes=True``), export the
Chrome trace and read the **c10d dispatcher ops** (``c10d::_allgather_base_``, ``c10d::allreduce_``,
``c10d::_reduce_scatter_base_``, ...). Why this level:

* Every system reaches the process group through these ops: Thunder's torch executor and FSDP2 call
  ``torch.distributed.all_gather_into_tensor`` / ``reduce_scatter_tensor`` (-> ``c10d::_allgather_base_``,
  ``c10d::_reduce_scatter_base_``), and DDP's C++ reducer calls ``ProcessGroup::allreduce``, which
  dispatches ``c10d::allreduce_`` too, so a Python monkeypatch of ``torch.distributed`` would miss DDP
  but the profiler does not.
* One event per *logical* collective, on the thread that issued it. The gloo backend additionally
  records ``gloo:all_gather`` / ``gloo:all_reduce`` on its worker threads, for the same collectives:
  counting both would double count. Those gloo events also name the algorithm, not the collective:
  gloo runs a reduce-scatter as an all-reduce of the full buffer followed by a local copy (it is
  recorded as ``gloo:all_reduce`` of the full size). The ring cost model below is about the logical
  collective, so the c10d level is the right one to count.
* Why the exported Chrome trace rather than ``prof.events()``: DDP passes a ``TensorList`` to
  ``c10d::allreduce_``, whose shapes ``FunctionEvent.input_shapes`` leaves empty, while the exported
  trace's ``Input Dims`` keeps them (nested). Single-tensor ops have them either way.

The gloo worker-thread events are still used for one thing: how long collectives were in flight
(``gloo_ms``: the wall time covered by at least one gloo event, i.e. the union of their intervals;
it includes waiting for the peer, and overlaps compute where a system overlaps communication).

Ring cost model, per rank, N ranks: an all-gather or reduce-scatter of a full buffer of S bytes costs
(N-1)/N * S, an all-reduce 2(N-1)/N * S. N is the size of the group the kind runs on: the world size,
except for HSDP rows, whose gathers and reduce-scatters run in the shard group and whose all-reduces run
over the replicate group (``group_sizes``).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from dataclasses import dataclass, field

from fsdp_pass.op_names import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER

# c10d op name -> (kind, which argument holds the *small* side, whether that side is scaled by N)
#   all-gather: the input (this rank's part) x N = full buffer
#   reduce-scatter: the output (this rank's part) x N = full buffer
#   all-reduce: the tensors themselves are the full buffer
_OPS: dict[str, tuple[str, int, bool]] = {
    "_allgather_base_": (ALL_GATHER, 1, True),
    "allgather_": (ALL_GATHER, 1, True),
    "allgather_coalesced_": (ALL_GATHER, 1, True),
    "allgather_into_tensor_coalesced_": (ALL_GATHER, 1, True),
    "_reduce_scatter_base_": (REDUCE_SCATTER, 0, True),
    "reduce_scatter_": (REDUCE_SCATTER, 0, True),
    "reduce_scatter_tensor_coalesced_": (REDUCE_SCATTER, 0, True),
    "allreduce_": (ALL_REDUCE, 0, False),
    "allreduce_coalesced_": (ALL_REDUCE, 0, False),
    "broadcast_": ("other", 0, False),
    "reduce_": ("other", 0, False),
    "gather_": ("other", 1, False),
    "scatter_": ("other", 0, False),
    "alltoall_": ("other", 1, False),
    "alltoall_base_": ("other", 1, False),
    "send": ("other", 0, False),
    "recv_": ("other", 0, False),
}
# not communication of data (or not part of a training step's traffic)
_IGNORED = {"barrier", "monitored_barrier_", "wait", "recv_any_source_"}

KINDS = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, "other")
SHORT = {ALL_GATHER: "AG", REDUCE_SCATTER: "RS", ALL_REDUCE: "AR", "other": "other"}

_DTYPE_BYTES = {
    "float": 4,
    "double": 8,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "half": 2,
    "bfloat16": 2,
    "long int": 8,
    "int": 4,
    "short int": 2,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
    "c10::Float8_e4m3fn": 1,
    "c10::Float8_e5m2": 1,
}


@dataclass
class StepComms:
    """What one rank communicated during one profiled step."""

    world_size: int
    group_sizes: dict = field(default_factory=dict)  # kind -> ranks of the group it runs on (default: the world)
    count: Counter = field(default_factory=Counter)  # kind -> number of collectives
    full_bytes: Counter = field(default_factory=Counter)  # kind -> sum of full-buffer sizes S
    gloo_ms: float = 0.0  # wall time with at least one collective running in a gloo worker thread
    gloo_events: int = 0  # backend-level events (a cross-check, not counted)
    unknown_size: int = 0  # collectives whose sizes the trace did not give (counted, 0 bytes)
    unknown_ops: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.count.values())

    def ranks(self, kind: str) -> int:
        return self.group_sizes.get(kind, self.world_size)

    def kind_bytes(self, kind: str) -> float:
        """Bytes this rank sends for the collectives of ``kind`` in the ring model."""
        n = self.ranks(kind)
        return (n - 1) / n * self.full_bytes[kind] * (2 if kind == ALL_REDUCE else 1)

    def ring_bytes(self) -> float:
        """Bytes this rank sends in the ring model."""
        return sum(self.kind_bytes(k) for k in KINDS)

    def breakdown(self) -> str:
        parts = [f"{self.count[k]} {SHORT[k]}" for k in KINDS if self.count[k]]
        return " + ".join(parts) if parts else "none"

    def as_dict(self) -> dict:
        return {
            "total": self.total,
            "breakdown": self.breakdown(),
            "count": dict(self.count),
            "full_bytes": dict(self.full_bytes),
            "ring_bytes": self.ring_bytes(),
            "all_reduce_bytes": self.kind_bytes(ALL_REDUCE),
            "gloo_ms": self.gloo_ms,
            "gloo_events": self.gloo_events,
            "unknown_size": self.unknown_size,
            "unknown_ops": dict(self.unknown_ops),
        }


def _numel(dims) -> int:
    """Elements in a recorded ``Input Dims`` entry: a shape, or (for tensor lists) a list of shapes."""
    if not dims:
        return 0
    if all(isinstance(d, int) for d in dims):
        n = 1
        for d in dims:
            n *= d
        return n
    return sum(_numel(d) for d in dims if isinstance(d, list))


def _union_length(intervals) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def comms_from_chrome_trace(
    trace: dict, world_size: int, default_elem_bytes: int = 4, group_sizes: dict | None = None
) -> StepComms:
    out = StepComms(world_size, dict(group_sizes or {}))
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    # element sizes the backend saw, by element count: tensor lists carry no dtype at the c10d level
    gloo_bytes_per_elem: dict[int, int] = {}
    intervals = []
    for e in events:
        name = e.get("name", "")
        if name.startswith("gloo:"):
            out.gloo_events += 1
            intervals.append((e.get("ts", 0.0), e.get("ts", 0.0) + e.get("dur", 0.0)))
            args = e.get("args", {})
            dims, types = args.get("Input Dims") or [], args.get("Input type") or []
            for d, t in zip(dims, types):
                if t in _DTYPE_BYTES:
                    gloo_bytes_per_elem.setdefault(_numel(d), _DTYPE_BYTES[t])
    out.gloo_ms = _union_length(intervals) / 1000.0
    for e in events:
        name = e.get("name", "")
        if not name.startswith("c10d::"):
            continue
        op = name[len("c10d::") :]
        if op in _IGNORED:
            continue
        if op not in _OPS:
            out.unknown_ops[op] += 1
            out.count["other"] += 1
            continue
        kind, arg, times_n = _OPS[op]
        args = e.get("args", {})
        dims = args.get("Input Dims") or []
        types = args.get("Input type") or []
        numel = _numel(dims[arg]) if arg < len(dims) else 0
        out.count[kind] += 1
        if numel == 0:
            out.unknown_size += 1
            continue
        t = types[arg] if arg < len(types) else None
        eb = _DTYPE_BYTES.get(t) or gloo_bytes_per_elem.get(numel, default_elem_bytes)
        out.full_bytes[kind] += numel * eb * (out.ranks(kind) if times_n else 1)
    return out


class CommsProfiler:
    """``with CommsProfiler(world_size) as cp: step()`` then ``cp.result`` (a :class:`StepComms`); ``group_sizes``:
    kind -> the ranks of the group it runs on, where not the world (HSDP)."""

    def __init__(self, world_size: int, keep_trace: str | None = None, group_sizes: dict | None = None):
        self.world_size = world_size
        self.group_sizes = group_sizes
        self.keep_trace = keep_trace
        self.result: StepComms | None = None

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)
        if exc[0] is not None:
            return False
        fd, path = tempfile.mkstemp(suffix=".json", prefix="bench_comms_")
        os.close(fd)
        try:
            self._prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
            if self.keep_trace:
                os.replace(path, self.keep_trace)
        finally:
            if os.path.exists(path):
                os.remove(path)
        self.result = comms_from_chrome_trace(trace, self.world_size, group_sizes=self.group_sizes)
        return False
