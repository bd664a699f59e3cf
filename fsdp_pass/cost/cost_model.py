"""What a collective and a unit's compute cost, from named inputs: the α–β model of a link and a device's rate.

``LinkCost(alpha_s, bytes_per_s)``: a collective over a group of N ranks whose full buffer is S bytes takes

    alpha_s + sent(S, N) / bytes_per_s,   sent(S, N) = (N-1)/N * S  (all-gather, reduce-scatter; ring)
                                                       2(N-1)/N * S (all-reduce: a reduce-scatter, then an
                                                                     all-gather)

``alpha_s`` is the latency each collective pays whatever its size (why one collective per unit beats one per
parameter); ``bytes_per_s`` is what a rank sends per second once the collective is large (NCCL calls it the
bus bandwidth). :func:`fit_link` finds both from measured (bytes sent, seconds) pairs, by least squares on
that line; :mod:`fsdp_pass.cost.probe` measures them on the user's ranks.

``CostInputs``: the link of the shard group (under HSDP also the one between its replicas, ``probe(group=the
replicate group)`` measures it), the device's matmul rate, the copy rate to and from the host (what offloading
pays), and where the numbers came from; and, where measured, what the rest of a step costs: each op's host time
(Python, dispatch, a kernel launch), the rate elementwise ops move memory at, and the optimizer step per
parameter tensor and per byte. Left at their defaults (zero, None) a step is its matmuls and its collectives.
:data:`DEFAULTS` holds two sets, each with its source written next to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdp_pass.errors import check
from fsdp_pass.op_names import ALL_REDUCE, CollectiveKind


def sent_bytes(full_bytes: float, ranks: int, kind: CollectiveKind) -> float:
    """What each rank sends for one collective of a full buffer of ``full_bytes`` over ``ranks`` (ring)."""
    if ranks <= 1:
        return 0.0
    return full_bytes * (ranks - 1) / ranks * (2 if kind is ALL_REDUCE else 1)


@dataclass(frozen=True)
class LinkCost:
    """The α–β cost of collectives over one kind of link."""

    alpha_s: float  # seconds every collective pays, however small
    bytes_per_s: float  # bytes each rank sends per second in a large collective

    def seconds(self, full_bytes: float, ranks: int, kind: CollectiveKind) -> float:
        if ranks <= 1:
            return 0.0
        return self.alpha_s + sent_bytes(full_bytes, ranks, kind) / self.bytes_per_s

    def __str__(self) -> str:
        return f"alpha {self.alpha_s * 1e6:.1f} us, beta {self.bytes_per_s / 1e9:.3g} GB/s"


def fit_link(points) -> LinkCost:
    """The line ``seconds = alpha + sent / beta`` through ``(bytes sent, seconds)`` points (at least two
    different sizes), fitted by least squares on the *relative* error (each point weighted 1/seconds²), so that
    the small collectives, where the latency shows, count as much as the large ones, where the bandwidth does.
    A fitted latency below zero (noise at small sizes) is taken as zero."""
    xs, ys = zip(*points) if points else ((), ())
    check(
        len(set(xs)) >= 2 and min(ys, default=0) > 0,
        f"fit_link needs positive times at two sizes or more, got {len(set(xs))} size(s).",
        "Measure collectives of several sizes, e.g. 1 KiB to 16 MiB (fsdp_pass.cost.probe does).",
    )
    w = [1.0 / y**2 for y in ys]
    sw = sum(w)
    mx, my = sum(wi * x for wi, x in zip(w, xs)) / sw, sum(wi * y for wi, y in zip(w, ys)) / sw
    spread = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs))
    slope = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys)) / spread
    check(
        slope > 0,
        "The measured collectives did not take longer as they grew: no bandwidth can be fitted.",
        "Measure again on an idle machine, with larger sizes (the probe's --max-bytes).",
    )
    return LinkCost(max(my - slope * mx, 0.0), 1.0 / slope)


@dataclass(frozen=True)
class CostInputs:
    """What the cost of a step is computed from."""

    link: LinkCost  # the shard group's collectives
    flops_per_s: float  # the device's matmul rate, in the dtype the step computes in
    source: str  # where the numbers come from
    # bytes per second between the device and where offloaded shards live (one direction); None: not measured
    host_bytes_per_s: float | None = None
    # the share of a collective's time that compute running beside it hides: 1 when the two do not slow each
    # other (a GPU's copy engines and spare SMs), less where they share the same cores (gloo on a busy CPU)
    overlap: float = 1.0
    # host time of one op of the executed trace: Python, the dispatcher, a kernel launch
    op_s: float = 0.0
    # bytes per second that elementwise ops read and write together; None: not measured (not counted)
    memory_bytes_per_s: float | None = None
    # the host queues work ahead of the device (CUDA streams): a stretch of ops takes the longer of its host
    # time and its device time; False (a CPU, which computes what it dispatches): the sum of the two
    host_async: bool = False
    # the optimizer step (AdamW): seconds per parameter tensor, and bytes of parameters stepped per second
    optimizer_tensor_s: float = 0.0
    optimizer_bytes_per_s: float | None = None
    # HSDP: the link between the replicas of a shard group (across nodes); None: the shard group's link
    replicate_link: LinkCost | None = None

    @property
    def across_replicas(self) -> LinkCost:
        return self.replicate_link or self.link

    def compute_seconds(self, flops: float, ops: float = 0, moved_bytes: float = 0) -> float:
        """A stretch of ``ops`` ops holding ``flops`` matmul FLOPs and moving ``moved_bytes`` in elementwise ops."""
        device = flops / self.flops_per_s + (moved_bytes / self.memory_bytes_per_s if self.memory_bytes_per_s else 0)
        host = ops * self.op_s
        return max(device, host) if self.host_async else device + host

    def optimizer_seconds(self, tensors: int, param_bytes: float) -> float:
        """One optimizer step over ``tensors`` parameter tensors of ``param_bytes`` bytes in all (this rank's)."""
        per_byte = param_bytes / self.optimizer_bytes_per_s if self.optimizer_bytes_per_s else 0.0
        return tensors * self.optimizer_tensor_s + per_byte

    def __str__(self) -> str:
        hides = "" if self.overlap >= 1 else f", compute hides {self.overlap:.0%} of a collective beside it"
        host = f", {self.op_s * 1e6:.3g} us per op" if self.op_s else ""
        memory = f", elementwise {self.memory_bytes_per_s / 1e9:.3g} GB/s" if self.memory_bytes_per_s else ""
        across = f", across replicas {self.replicate_link}" if self.replicate_link else ""
        matmul = f"matmul {self.flops_per_s / 1e12:.3g} TFLOP/s"
        return f"{self.link}; {matmul}{host}{memory}{hides}{across} ({self.source})"


DEFAULTS = {
    # NVIDIA's H100 SXM datasheet: 989 TFLOP/s dense bf16 (we take 60 %, what large GEMMs reach in
    # practice); NVLink 4: 900 GB/s per GPU, both directions together, so 450 GB/s each way. nccl-tests report
    # bus bandwidths near 360 GB/s for large all-gathers within one 8-GPU node. NCCL's latency for a small
    # collective on NVLink: about 10-20 us.
    # Host copies: PCIe Gen5 x16 is 64 GB/s each way; pinned copies reach about 50 GB/s.
    # The rest of the step, measured on one H100 80GB HBM3 of this workplace, 2026-11-25, by `probe` at one rank
    # (NCCL; `python -m fsdp_pass probe` and bench.gpu's probes, five runs): a tiny op costs the host 6.8 / 8.4 /
    # 9.8 / 12.8 / 14.3 us (the median, 9.8 us: the 10 us we had estimated stays), and the host runs ahead;
    # a 64 MiB elementwise multiply moves 2.80 / 2.81 / 2.84 / 2.89 / 2.94 TB/s (85 % of HBM3's 3.35; the
    # median); torch's AdamW (foreach on CUDA) takes 16.4 us per parameter tensor and steps 136 GB of float32
    # parameters per second (one run; 4/28 of the memory rate, its 28 bytes of traffic per parameter, would be
    # 400: its foreach ops write temporaries). The float32 matmul at 4096 ran at 51 TFLOP/s, the bfloat16 one at
    # 653; this set keeps 60 % of the datasheet's bfloat16 rate, nearer what the model's smaller GEMMs reach.
    # Across nodes (HSDP's replicas): one 400 Gb/s InfiniBand NDR adapter per GPU (DGX H100), 50 GB/s each way, of
    # which nccl-tests reach about 90 % across nodes; latency a few tens of microseconds (estimates).
    "h100-nvlink": CostInputs(
        LinkCost(15e-6, 360e9), 0.6 * 989e12, "H100 datasheet, NVLink 4, nccl-tests, IB NDR; host, HBM probed", 50e9,
        op_s=10e-6, memory_bytes_per_s=2.84e12, host_async=True, optimizer_tensor_s=16.4e-6,
        optimizer_bytes_per_s=136e9, replicate_link=LinkCost(30e-6, 45e9),
    ),
    # this project's 2-core development machine, 2 gloo ranks on loopback (one thread each), idle (load average
    # 0.3), 2026-11-24, `python -m fsdp_pass probe --local-ranks 2` three times: alpha 313 / 267 / 195 us, beta
    # 1.19 / 0.885 / 1.21 GB/s, a 512 x 512 float32 matmul 89.9 / 76.7 / 89.2 GFLOP/s, compute beside a 4 MiB
    # all-gather hides 15 / 0 / 0 % of it (gloo's threads and the compute share the two cores): the medians.
    # Four ranks on the two cores: alpha 1.44 ms, beta 0.666 GB/s, 46.5 GFLOP/s, overlap 0 %. With other jobs on
    # the cores (load average 7): alpha 893 us, beta 0.277 GB/s, 9 GFLOP/s.
    # "Offloading" to the CPU from the CPU is a copy into fresh memory: a 64 MiB float32 clone ran at 1.0 GB/s
    # (fastest of 5, the test suite running beside it).
    # The rest of the step, idle, 2026-11-25, the same probe three times: 3.05 / 3.20 / 1.58 us per op, elementwise
    # ops on 1 MiB tensors 30.3 / 29.3 / 37.5 GB/s, AdamW (single-tensor on a CPU) 83.7 / 82.8 / 112 us per
    # parameter tensor and 1.16 / 1.03 GB of parameters per second (the last two runs; the first timed one 4 MiB
    # tensor, whose temporaries are mapped afresh each step): the medians.
    "cpu-gloo": CostInputs(
        LinkCost(267e-6, 1.19e9), 89.2e9, "probe, 2 gloo ranks on the 2-core dev machine, idle", 1e9, overlap=0.0,
        op_s=3.05e-6, memory_bytes_per_s=30.3e9, optimizer_tensor_s=83.7e-6, optimizer_bytes_per_s=1.1e9,
    ),
}


def device_defaults(device) -> tuple[CostInputs, int | None]:
    """The cost inputs and the memory budget of the device a step computes on (None: the CPU): ``h100-nvlink`` and
    the CUDA device's memory; else ``cpu-gloo`` and no bound (the CPU, the meta device of a dry run)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        return DEFAULTS["h100-nvlink"], torch.cuda.get_device_properties(device).total_memory
    return DEFAULTS["cpu-gloo"], None
