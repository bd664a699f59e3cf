"""Measure what the cost model needs on the ranks at hand: a collective's latency and bandwidth, a matmul's rate.

    torchrun --nproc_per_node=8 -m fsdp_pass probe     # on the user's ranks (the default process group)
    python -m fsdp_pass probe --local-ranks 2           # spawns 2 gloo ranks on this machine

1. All-gathers of full buffers from ``min_bytes`` to ``max_bytes`` (powers of 4) over the group: each size
   ``repeats`` times after one warm-up, every rank starting together (a barrier), the slowest rank's time
   kept (an all-reduce of the times, MAX), the fastest of the repeats (on a shared host the others measure
   the neighbours too).
2. :func:`fsdp_pass.cost.cost_model.fit_link` fits ``seconds = alpha + sent / beta`` to (bytes each rank
   sent, seconds): the latency every collective pays, the bandwidth large ones reach. When the times do not
   grow with the size (a busy host's noise drowning the small sizes), the gathers are measured again with
   twice the repeats, up to three times in all; every rank holds the same times, so all retry together.
3. A square float32 matmul on the device, timed: the rate compute runs at (the slowest rank's).
4. A 4 MiB all-gather alone, matmuls of about as long alone, then both at once: the share of the gather's
   time the compute hides (``CostInputs.overlap``; on a CPU whose cores run both, well below 1).
5. The rest of a step (:func:`host_costs`): a tiny elementwise op (each op's host time), one on 1 MiB tensors
   (the memory rate elementwise ops run at), and AdamW steps over many tiny tensors and over 16 of 256 KiB
   (the optimizer's time per parameter tensor and per byte).

Every rank gets the same numbers (each is agreed over the group), so plans made from them agree too.

The result prints as a table of measured against fitted times, so a reader sees how well two numbers
describe the link.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_pass.errors import FSDPError
from fsdp_pass.op_names import ALL_GATHER
from fsdp_pass.cost.cost_model import CostInputs, LinkCost, fit_link, sent_bytes
from fsdp_pass.text import format_table, human_bytes
from fsdp_pass.ranks import reduced_across_ranks, run_on_local_ranks


@dataclass(frozen=True)
class ProbeResult:
    ranks: int
    points: tuple[tuple[int, float], ...]  # (full buffer bytes, seconds) per size
    cost: CostInputs

    @property
    def link(self) -> LinkCost:
        return self.cost.link

    def __str__(self) -> str:
        rows = []
        for full, seconds in self.points:
            fitted = self.link.seconds(full, self.ranks, ALL_GATHER)
            rows.append((human_bytes(full), human_bytes(int(sent_bytes(full, self.ranks, ALL_GATHER))),
                         f"{seconds * 1e3:.3f}", f"{fitted * 1e3:.3f}"))
        table = format_table(("all-gather of", "sent/rank", "measured ms", "fitted ms"), rows)
        link = [f"{self.ranks} ranks: time = alpha + sent/beta with {self.link}", *table] if self.ranks > 1 else [
            "1 rank: no collectives to measure (a link of one rank costs nothing)"]
        overlap = [f"overlap: compute beside a 4 MiB all-gather hides {self.cost.overlap:.0%} of its time"]
        return "\n".join([
            *link,
            f"matmul: {self.cost.flops_per_s / 1e9:.1f} GFLOP/s",
            *(overlap if self.ranks > 1 else []),
            f"per op: {self.cost.op_s * 1e6:.2f} us on the host; elementwise ops move "
            f"{(self.cost.memory_bytes_per_s or 0) / 1e9:.3g} GB/s",
            f"AdamW: {self.cost.optimizer_tensor_s * 1e6:.1f} us per parameter tensor, "
            f"{(self.cost.optimizer_bytes_per_s or 0) / 1e9:.3g} GB of parameters per second",
        ])


def _sizes(min_bytes: int, max_bytes: int) -> list[int]:
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 4
    return sizes


def time_all_gathers(group, sizes, repeats: int, device, clock=time.perf_counter) -> list[tuple[int, float]]:
    """(full buffer bytes, the fastest repeat of the slowest rank's seconds) per size, float32 buffers. ``clock``
    is read right before and right after each gather, the warm-up's too (a test hands canned times)."""
    ranks = dist.get_world_size(group)
    points = []
    for full in sizes:
        part = torch.ones(max(full // 4 // ranks, 1), device=device)
        out = torch.empty(part.numel() * ranks, device=device)
        times = []
        for i in range(repeats + 1):
            dist.barrier(group=group)
            t0 = clock()
            dist.all_gather_into_tensor(out, part, group=group)
            if out.is_cuda:
                torch.cuda.synchronize(out.device)
            seconds = clock() - t0
            if i:  # the first is a warm-up
                times.append(seconds)
        points.append((out.numel() * 4, min(reduced_across_ranks(times, dist.ReduceOp.MAX, group))))
    return points


def matmul_flops_per_s(device, n: int | None = None, repeats: int = 5, dtype=torch.float32) -> float:
    """A square matmul's rate: ``n`` 512 on a CPU, 4096 on CUDA (where a smaller one times the launch)."""
    n = n or (4096 if torch.device(device).type == "cuda" else 512)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        a @ b
        if a.is_cuda:
            torch.cuda.synchronize(a.device)
        if i:
            times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def _fastest(fn, device, repeats: int) -> float:
    best = float("inf")
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first is a warm-up
            best = min(best, time.perf_counter() - t0)
    return best


def host_costs(device, repeats: int = 5) -> tuple[float, float, float, float]:
    """(seconds per op on the host, elementwise bytes moved per second, AdamW seconds per parameter tensor,
    AdamW parameter bytes per second) on this rank: the fastest of ``repeats``."""
    tiny, n_tiny = torch.ones(16, device=device), 200

    def tiny_ops():
        for _ in range(n_tiny):
            torch.add(tiny, tiny)

    op_s = _fastest(tiny_ops, device, repeats) / n_tiny
    # 1 MiB each on a CPU; 64 MiB on CUDA, where 1 MiB moves in about a microsecond and times the launch
    cuda = device.type == "cuda"
    numel = 1 << (24 if cuda else 18)
    x, y = torch.ones(numel, device=device), torch.ones(numel, device=device)
    z = torch.empty_like(x)
    moved = 3 * x.numel() * x.element_size()
    elementwise_s = _fastest(lambda: torch.mul(x, y, out=z), device, repeats)
    memory_rate = moved / max(elementwise_s - op_s, 1e-9)

    def adamw(tensors: int, numel: int) -> float:
        params = [torch.zeros(numel, device=device, requires_grad=True) for _ in range(tensors)]
        for p in params:
            p.grad = torch.ones_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3)
        return _fastest(opt.step, device, repeats)

    # many tiny tensors: the time per tensor; 16 of 256 KiB (a layer's weights, small enough to be allocated
    # like them; 16 MiB on CUDA, where 256 KiB times the launches): the time per byte
    n_small, n_large, large_numel = 32, 16, 1 << (22 if cuda else 16)
    tensor_s = adamw(n_small, 64) / n_small
    large_bytes = n_large * large_numel * 4
    optimizer_rate = large_bytes / max(adamw(n_large, large_numel) - n_large * tensor_s, 1e-9)
    return op_s, memory_rate, tensor_s, optimizer_rate


def hidden_share(gather_s: float, compute_s: float, together_s: float) -> float:
    """The share of an all-gather's time that compute beside it hides: ``(gather + compute - together) /
    min(gather, compute)``, kept between 0 (running both took as long as one after the other, or longer: on a
    host whose cores run both, the gather slowed the compute) and 1 (the shorter one hidden whole)."""
    share = (gather_s + compute_s - together_s) / min(gather_s, compute_s)
    return min(max(share, 0.0), 1.0)


def overlap_share(group, device, nbytes: int = 4 << 20, repeats: int = 3, clock=time.perf_counter) -> float:
    """:func:`hidden_share` on the slowest rank (the lowest share over the group): time the gather alone, matmuls
    of about as long alone, then both at once (the gather issued asynchronously), each the fastest of
    ``repeats``. ``clock`` is read right before and right after each timed run (a test hands canned times)."""
    ranks = dist.get_world_size(group)
    part = torch.ones(max(nbytes // 4 // ranks, 1), device=device)
    out = torch.empty(part.numel() * ranks, device=device)
    a = torch.randn(256, 256, device=device)

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(repeats):
            dist.barrier(group=group)
            t0 = clock()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, clock() - t0)
        return best

    gather = timed(lambda: dist.all_gather_into_tensor(out, part, group=group))
    one = timed(lambda: a @ a)
    n = max(int(gather / max(one, 1e-9)), 1)

    def compute():
        for _ in range(n):
            a @ a

    def both():
        work = dist.all_gather_into_tensor(out, part, group=group, async_op=True)
        compute()
        work.wait()

    alone = timed(compute)
    together = timed(both)
    [share] = reduced_across_ranks([hidden_share(gather, alone, together)], dist.ReduceOp.MIN, group)
    return share


def fitted(measure, ranks: int, attempts: int = 3) -> tuple[tuple, LinkCost]:
    """``(points, link)``: ``measure(attempt)`` gives (full bytes, seconds) points; fit them, measuring again
    (attempt 1, 2, ...) while no bandwidth can be fitted; the last attempt's FSDPError is raised."""

    def fit(points) -> LinkCost:
        return fit_link([(sent_bytes(full, ranks, ALL_GATHER), s) for full, s in points])

    for attempt in range(attempts - 1):
        points = measure(attempt)
        try:
            return tuple(points), fit(points)
        except FSDPError:
            continue
    points = measure(attempts - 1)
    return tuple(points), fit(points)


def probe(group=None, *, min_bytes: int = 1 << 10, max_bytes: int = 16 << 20, repeats: int = 5, device=None,
          dtype=torch.float32, clock=time.perf_counter):
    """Collective: every rank of ``group`` (the default group if None) calls it. Returns a ProbeResult.
    ``dtype``: what the matmul computes in (the step's compute dtype: bfloat16 under mixed precision). One rank
    has no collectives to measure: its link costs nothing, and only the compute and the host are probed.
    ``clock``: what times the all-gathers the link is fitted to (:func:`time_all_gathers`) and the runs the
    overlap is computed from (:func:`overlap_share`)."""
    group = group if group is not None else dist.group.WORLD
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ranks = dist.get_world_size(group)
    if ranks > 1:
        sizes = _sizes(min_bytes, max_bytes)
        points, link = fitted(lambda attempt: time_all_gathers(group, sizes, repeats << attempt, device, clock), ranks)
    else:
        points, link = (), LinkCost(0.0, float("inf"))
    where = f"probe: {ranks} ranks, {dist.get_backend(group)}, {device.type}"
    if dtype != torch.float32:
        where += f", {str(dtype).removeprefix('torch.')} matmul"
    # the slowest rank's rate: every rank gets the same numbers, so an auto plan made from them is the same
    [rate] = reduced_across_ranks([matmul_flops_per_s(device, dtype=dtype)], dist.ReduceOp.MIN, group)
    overlap = overlap_share(group, device, clock=clock) if ranks > 1 else 1.0
    # the slowest rank's times, the slowest rank's rates
    op_s, memory_rate, tensor_s, optimizer_rate = host_costs(device)
    slowest = [op_s, 1 / memory_rate, tensor_s, 1 / optimizer_rate]
    op_s, memory_s, tensor_s, optimizer_s = reduced_across_ranks(slowest, dist.ReduceOp.MAX, group)
    cost = CostInputs(link, float(rate), where, overlap=overlap, op_s=op_s, memory_bytes_per_s=1 / memory_s,
                      host_async=device.type == "cuda", optimizer_tensor_s=tensor_s,
                      optimizer_bytes_per_s=1 / optimizer_s)
    return ProbeResult(ranks, points, cost)


def probe_local_ranks(world: int, **kwargs) -> ProbeResult:
    """:func:`probe` on ``world`` gloo ranks spawned on this machine (one CPU thread each)."""
    return run_on_local_ranks(probe, world, timeout_s=300, **kwargs)[0]


def add_parser(commands) -> None:
    p = commands.add_parser(
        "probe",
        help="measure collective latency and bandwidth, and a matmul's rate, on these ranks",
        description="Measure all-gathers of growing size and fit time = alpha + sent/beta; time a matmul.",
    )
    p.add_argument("--local-ranks", type=int, default=None, help="spawn this many gloo ranks here (no torchrun)")
    p.add_argument("--min-bytes", type=int, default=1 << 10)
    p.add_argument("--max-bytes", type=int, default=16 << 20)
    p.add_argument("--repeats", type=int, default=5)


def probe_command(ns: argparse.Namespace) -> int:
    kwargs = {"min_bytes": ns.min_bytes, "max_bytes": ns.max_bytes, "repeats": ns.repeats}
    if ns.local_ranks is not None:
        print(probe_local_ranks(ns.local_ranks, **kwargs))
        return 0
    dist.init_process_group()
    try:
        result = probe(**kwargs)
        if dist.get_rank() == 0:
            print(result)
    finally:
        dist.destroy_process_group()
    return 0
