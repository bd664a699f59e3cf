"""The cost model's arithmetic and fit (pure), and the probe that measures its inputs on 2 gloo ranks."""

from __future__ import annotations

import random

import pytest

from fsdp_pass import FSDPError
from fsdp_pass.op_names import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from fsdp_pass.cost.cost_model import DEFAULTS, CostInputs, LinkCost, fit_link, sent_bytes
from fsdp_pass.cost.probe import hidden_share, probe

SIZES = [1 << k for k in range(10, 25, 2)]  # 1 KiB .. 16 MiB


def test_ring_bytes_and_seconds():
    assert sent_bytes(8000, 8, ALL_GATHER) == sent_bytes(8000, 8, REDUCE_SCATTER) == 7000
    assert sent_bytes(8000, 8, ALL_REDUCE) == 14000  # a reduce-scatter, then an all-gather
    assert sent_bytes(8000, 1, ALL_REDUCE) == 0
    link = LinkCost(alpha_s=20e-6, bytes_per_s=1e9)
    assert link.seconds(8000, 8, ALL_GATHER) == pytest.approx(20e-6 + 7000 / 1e9)
    assert link.seconds(8000, 1, ALL_GATHER) == 0.0  # one rank: nothing to send, no collective
    # many small collectives pay the latency each time: 64 gathers of 8 KiB cost 63 latencies more than one of
    # 512 KiB (the same bytes)
    per_parameter = 64 * link.seconds(8 * 1024, 8, ALL_GATHER)
    assert per_parameter - link.seconds(64 * 8 * 1024, 8, ALL_GATHER) == pytest.approx(63 * link.alpha_s)


def test_fit_recovers_latency_and_bandwidth():
    alpha, beta = 50e-6, 2e9
    exact = [(s, alpha + s / beta) for s in SIZES]
    fitted = fit_link(exact)
    assert fitted.alpha_s == pytest.approx(alpha, rel=1e-6) and fitted.bytes_per_s == pytest.approx(beta, rel=1e-6)
    rng = random.Random(0)
    noisy = [(s, t * rng.uniform(0.95, 1.05)) for s, t in exact]  # 5 % noise on every point
    fitted = fit_link(noisy)
    assert fitted.alpha_s == pytest.approx(alpha, rel=0.15) and fitted.bytes_per_s == pytest.approx(beta, rel=0.15)


def test_fit_refuses_what_it_cannot_fit():
    with pytest.raises(FSDPError, match="two sizes or more"):
        fit_link([(1024, 1e-3), (1024, 2e-3)])
    with pytest.raises(FSDPError, match="did not take longer"):
        fit_link([(1024, 2e-3), (1 << 20, 1e-3)])


def test_defaults_say_where_they_come_from():
    for name, inputs in DEFAULTS.items():
        assert inputs.source and inputs.link.alpha_s > 0 and inputs.link.bytes_per_s > 0, name
        assert inputs.flops_per_s > 0 and str(inputs)


def test_compute_adds_host_time_on_a_cpu_and_overlaps_it_where_the_host_runs_ahead():
    cpu = CostInputs(LinkCost(1e-5, 1e9), 1e9, "hand-made", op_s=1e-3, memory_bytes_per_s=1e6)
    # 1e9 FLOPs: 1 s; 2e6 bytes moved: 2 s; 3 ops: 3 ms of host time
    assert cpu.compute_seconds(1e9, 3, 2e6) == pytest.approx(1 + 2 + 3e-3)
    gpu = CostInputs(LinkCost(1e-5, 1e9), 1e9, "hand-made", op_s=1e-3, memory_bytes_per_s=1e6, host_async=True)
    assert gpu.compute_seconds(1e9, 3, 2e6) == pytest.approx(3)  # the device's time hides the host's
    assert gpu.compute_seconds(0, 5000, 0) == pytest.approx(5)  # a host-bound stretch: the host's
    plain = CostInputs(LinkCost(1e-5, 1e9), 1e9, "hand-made")  # nothing measured beyond the matmul rate
    assert plain.compute_seconds(1e9, 3, 2e6) == pytest.approx(1) and plain.optimizer_seconds(40, 1e9) == 0
    adam = CostInputs(LinkCost(1e-5, 1e9), 1e9, "hand-made", optimizer_tensor_s=1e-4, optimizer_bytes_per_s=1e9)
    assert adam.optimizer_seconds(40, 2e9) == pytest.approx(40 * 1e-4 + 2)


# the link the canned all-gather times describe, on the fastest rank; rank r's take (1 + r / 2) times as long
CANNED_ALPHA_S, CANNED_BYTES_PER_S = 50e-6, 2e8


def canned_gather_seconds(full: int, rank: int, ranks: int = 2) -> float:
    return (CANNED_ALPHA_S + sent_bytes(full, ranks, ALL_GATHER) / CANNED_BYTES_PER_S) * (1 + rank / 2)


class CannedClock:
    """A clock read twice around each all-gather (:func:`fsdp_pass.cost.probe.time_all_gathers`): the pair of
    reads of gather k lies ``seconds[k]`` apart."""

    def __init__(self, seconds):
        self.seconds, self.now, self.reads = iter(seconds), 0.0, 0

    def __call__(self) -> float:
        if self.reads % 2:
            self.now += next(self.seconds)
        self.reads += 1
        return self.now


# the overlap's timed runs on each rank (the gather alone, one matmul, matmuls alone, both at once): the fastest of
# each run's 3 repeats; rank 0 hides (0.25 + 0.5 - 0.55) / 0.25 = 80 % of the gather, rank 1 (slowest) 40 %
CANNED_OVERLAP_RUNS_S = {0: (0.25, 0.125, 0.5, 0.55), 1: (0.25, 0.125, 0.5, 0.65)}
CANNED_OVERLAP = 0.4


def probe_small(repeats: int = 2):
    """On every rank: the probe on small sizes (a few seconds), its all-gathers run for real and timed by a canned
    clock (the fit must not depend on this machine's load; ``python -m fsdp_pass probe`` times them for real):
    each size's warm-up 1 s, then its canned time, twice as long in its first repeat (the probe keeps the
    fastest); the overlap's runs too (:data:`CANNED_OVERLAP_RUNS_S`). The matmul and the host are timed for real."""
    import torch.distributed as dist

    from fsdp_pass.cost.probe import _sizes

    rank = dist.get_rank()
    sizes = _sizes(1 << 10, 1 << 20)
    seconds = [s for full in sizes for s in [1.0, *[canned_gather_seconds(full, rank) * (2 if i == 0 else 1)
                                                     for i in range(repeats)]]]
    seconds += [s for run in CANNED_OVERLAP_RUNS_S[rank] for s in (2 * run, run, run)]  # its 3 repeats, run by run
    result = probe(max_bytes=1 << 20, repeats=repeats, clock=CannedClock(seconds))
    return {"points": result.points, "alpha": result.link.alpha_s, "beta": result.link.bytes_per_s,
            "flops": result.cost.flops_per_s, "overlap": result.cost.overlap, "text": str(result),
            "host": (result.cost.op_s, result.cost.memory_bytes_per_s, result.cost.optimizer_tensor_s,
                     result.cost.optimizer_bytes_per_s)}


def test_probe_measures_again_when_noise_hides_the_bandwidth():
    from fsdp_pass.cost.probe import fitted

    noisy = [(1 << 10, 3e-3), (1 << 20, 1e-3)]  # the small gather slower than the large: nothing to fit
    clean = [(1 << 10, 1e-4), (1 << 20, 1e-3)]
    asked = []

    def measure(attempt):
        asked.append(attempt)
        return noisy if attempt < 2 else clean

    points, link = fitted(measure, ranks=2)
    assert asked == [0, 1, 2] and points == tuple(clean) and link.bytes_per_s > 0
    with pytest.raises(FSDPError, match="did not take longer as they grew"):
        fitted(lambda attempt: noisy, ranks=2)


def test_probe_measures_on_two_gloo_ranks(ranks):
    """The link fitted to the slowest rank's fastest repeats: the canned times of rank 1 (1.5x rank 0's), on every
    rank, and the latency and bandwidth they were made from."""
    results = ranks(2).run(probe_small)
    r = results[0]
    sizes = [1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20]
    assert [full for full, _ in r["points"]] == sizes
    assert [s for _, s in r["points"]] == pytest.approx([canned_gather_seconds(full, rank=1) for full in sizes])
    assert r["alpha"] == pytest.approx(1.5 * CANNED_ALPHA_S, rel=1e-6)
    assert r["beta"] == pytest.approx(CANNED_BYTES_PER_S / 1.5, rel=1e-6) and r["flops"] > 0
    assert results[1]["points"] == r["points"]  # the slowest rank's times: the same numbers on every rank
    assert results[1]["flops"] == r["flops"]  # the slowest rank's matmul rate: an auto plan made from them agrees
    # the slowest rank's share of the gather its compute hides, from the fastest repeats, on every rank
    assert r["overlap"] == pytest.approx(CANNED_OVERLAP, rel=1e-9) and results[1]["overlap"] == r["overlap"]
    # per op, elementwise memory rate, AdamW per tensor and per byte: measured, and the slowest rank's everywhere
    assert all(x > 0 for x in r["host"]) and results[1]["host"] == r["host"]
    assert "per op" in r["text"] and "AdamW" in r["text"]
    assert "time = alpha + sent/beta" in r["text"] and "fitted ms" in r["text"]


def test_the_hidden_share_is_kept_between_none_and_all():
    assert hidden_share(1.0, 2.0, 2.5) == pytest.approx(0.5)  # half the gather ran beside the compute
    assert hidden_share(2.0, 1.0, 2.0) == 1.0  # the shorter (the compute) hidden whole
    assert hidden_share(1.0, 1.0, 2.5) == 0.0  # both at once slower than one after the other: nothing hidden


def test_probe_of_one_rank_measures_compute_and_host_but_no_link():
    import torch

    from fsdp_pass import fake_process_group

    with fake_process_group(1):
        r = probe(device="cpu", dtype=torch.float64)
    assert r.ranks == 1 and r.points == () and r.link.seconds(1 << 20, 1, ALL_GATHER) == 0.0
    assert r.cost.flops_per_s > 0 and r.cost.op_s > 0 and "float64 matmul" in r.cost.source
    assert "no collectives to measure" in str(r) and "fitted ms" not in str(r)


def test_a_causal_attention_run_as_one_kernel_counts_the_pairs_it_computes():
    """Attention FLOPs: 4*b*h*d per (query, key) pair; a causal kernel computes the s(s+1)/2 pairs a query sees
    (about half of s*s), computed op by op (masked after) all s*s; a non-causal attention all s*s."""
    import thunder
    import thunder.torch as ltorch
    import torch

    from fsdp_pass.cost.op_flops import causal_pairs, estimated_flops

    b, h, s, d = 2, 3, 64, 16
    q = torch.empty(b, h, s, d, device="meta")

    def attentions(q):
        return ltorch.scaled_dot_product_attention(q, q, q, is_causal=True), ltorch.scaled_dot_product_attention(q, q, q)

    causal, full = [x for x in thunder.trace()(attentions, q).bound_symbols if "scaled_dot_product" in x.sym.name]
    assert estimated_flops(full) == 4 * b * h * d * s * s
    assert estimated_flops(causal) == 4 * b * h * d * s * (s + 1) // 2
    assert estimated_flops(causal, skips_masked=False) == estimated_flops(full)
    assert causal_pairs(4, 4) == 10 and causal_pairs(2, 4) == 3 and causal_pairs(4, 2) == 7  # top-left aligned
