"""Rank functions for the explain tests: a real gloo step, measured (module-level so spawned ranks import them)."""

from __future__ import annotations

import time

import thunder
import torch
import torch.distributed as dist

from fsdp_pass import FSDP, BySize, explain, fsdp_of
from fsdp_pass.models import zoo
from fsdp_pass.report.measure import CollectiveBytes, allocated_during
from fsdp_pass_executors import executors_for
from fsdp_pass_executors.collectives import watching_issues

# small enough for a few seconds per step on 2 CPU ranks, big enough that every unit's bytes show
CONFIG = dict(vocab=256, d=64, n_head=4, hidden=176, n_layer=2, seq=32, local_batch=2)


def build_model(device="cpu"):
    """The model of these tests, with its loss inside (so the traces cover the whole step), and a batch."""
    torch.manual_seed(0)
    module, (idx, _) = zoo.build("tiny", device, **CONFIG)
    if device == "meta":
        return module, (idx, idx)
    g = torch.Generator().manual_seed(dist.get_rank() if dist.is_initialized() else 0)
    idx = torch.randint(0, CONFIG["vocab"], idx.shape, generator=g)
    return module, (idx, torch.roll(idx, -1, dims=1))


def measured_step(strategy: str, measured_steps: int = 3, units="blocks"):
    """Train a few steps with AdamW; measure the collectives and the allocations of the last ones. ``units``: as
    FSDP takes it (None: left out, the step model's default)."""
    module, args = build_model()
    unit_option = {} if units is None else {"units": units}
    jm = thunder.jit(module, transforms=[FSDP(strategy, **unit_option)], executors=executors_for("cpu"))
    opt = torch.optim.AdamW(jm.parameters(), lr=1e-3)

    def step():
        jm(*args).backward()

    peaks, recorded, calls, seconds = [], [], [], []
    results_are_inputs = []  # (kind, whether the collective's result is its input's storage) per collective
    for i in range(2 + measured_steps):  # two warm-up steps: compile, then the optimizer's state exists
        opt.zero_grad(set_to_none=True)
        if i < 2:
            step()
        else:
            started = time.perf_counter()
            with CollectiveBytes() as sent, watching_issues(lambda kind, out, inp, group, call: (
                results_are_inputs.append((kind, out.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr()))
                or call()
            )):
                allocations = allocated_during(step)
            seconds.append(time.perf_counter() - started)  # under the profiler: read, never asserted
            peaks.append(allocations.peak_bytes)
            recorded.append(allocations.recorded_peak_bytes)
            calls.append(sent)
        opt.step()
    e = explain(jm, optimizer="adam")
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    return {
        "measured_peaks": peaks,  # lost frees put back at their collective's wait
        "step_seconds": seconds,
        "units": [u.name for u in fsdp_of(jm).unit_plan.units],
        "recorded_peaks": recorded,  # the profiler's events as recorded
        "measured_bytes_sent": [c.bytes_sent_per_rank for c in calls],
        "measured_kinds": [sorted(k for k, _ in c.calls) for c in calls],
        "results_are_inputs": results_are_inputs,
        "measured_param_bytes": sum(p.numel() * p.element_size() for p in jm.parameters()),
        "measured_optimizer_bytes": sum(t.numel() * t.element_size() for t in state),
        "predicted_peak": e.memory.step.peak_bytes,
        "predicted_bytes_sent": e.bytes_per_rank,
        "predicted_kinds": sorted(c.kind for c in e.stats.collectives),
        "predicted_param_bytes": e.memory.sharded_params,
        "predicted_optimizer_bytes": e.memory.optimizer_state,
        "text": str(e),
    }


def measured_candidates() -> dict:
    """:func:`measured_step` under ZeRO-3 for two of the step model's candidate units: the default (``units=``
    left out: the step model's choice) and one unit holding the whole model (``BySize`` of any size)."""
    return {name: measured_step("zero3", 2, units) for name, units in (("default", None), ("one", BySize(10**12)))}
