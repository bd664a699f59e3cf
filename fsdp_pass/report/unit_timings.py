"""Time one training step under several FSDP plans on the ranks at hand: what the unit-size notebook measures.

:func:`time_plans` runs on every rank of the default group (``run_on_local_ranks(time_plans, 2, config, plans)``
spawns two gloo ranks). For each plan (the keyword arguments of one ``FSDP(...)``, e.g.
``{"units": "per_parameter"}``, or None for no FSDP at all) it jits the same :class:`~fsdp_pass.models.zoo.ResidualMLP`,
each rank on its own rows of one batch, and trains one warm-up step. Then ``steps`` rounds time one step
(forward, backward, ``opt.step()``, every rank starting together) of each plan in turn. A step's time is the
slowest rank's (an all-reduce of the times, MAX); each plan keeps its fastest step, since on a shared host the
others also measure the neighbours.

Each :class:`UnitTiming` also carries the compiled step's collectives (kind, full buffer, group) and its peak
gathered bytes, read off the final traces, so the notebook can hold the measured time against an α–β
prediction (:meth:`UnitTiming.predicted_comm_s`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import thunder
import torch
import torch.distributed as dist
from fsdp_pass_executors import executors_for

from fsdp_pass.models.zoo import ResidualMLP, regression_batch
from fsdp_pass.cost.cost_model import LinkCost
from fsdp_pass.report.step_stats import StepStats, step_stats
from fsdp_pass.ranks import reduced_across_ranks
from fsdp_pass.transform import FSDP


@dataclass(frozen=True)
class UnitTiming:
    name: str  # the label the caller gave the plan
    units: tuple[str, ...]  # the units' names, in order (none without FSDP)
    stats: StepStats  # the step's collectives and its peak gathered bytes (none without FSDP)
    step_s: float  # the fastest step, each step timed on the slowest rank
    compile_s: float  # jit and the first step (the trace is built on the first call)
    auto_plan: str | None = None  # FSDP("auto"): the plan as it prints, with the reason for each decision

    def predicted_comm_s(self, link: LinkCost) -> float:
        """Every collective of the step, one after the other, at ``link``'s α + sent/β."""
        return sum(link.seconds(c.full_bytes, c.group_size, c.kind) for c in self.stats.collectives)


def _slowest(seconds: float) -> float:
    return reduced_across_ranks([seconds], dist.ReduceOp.MAX)[0]


def time_plans(
    config: dict, plans: dict[str, dict | None], rows_per_rank: int = 64, steps: int = 6, seed: int = 0
) -> list[UnitTiming]:
    """One :class:`UnitTiming` per ``plans`` item (label -> ``FSDP`` keyword arguments, the strategy ``"zero3"``
    unless they name one; None: the model jitted without FSDP, every rank on its own, nothing communicated), in
    order. Every plan is compiled first; then ``steps`` rounds time one step of each in turn, so that a burst of
    load on the host slows all plans alike. Collective: every rank of the default group calls it with the same
    arguments."""
    rank, world = dist.get_rank(), dist.get_world_size()
    compiled = []
    for kwargs in plans.values():
        torch.manual_seed(seed)
        model = ResidualMLP(**config)
        inputs, targets = regression_batch(model, rows_per_rank * world)
        rows = slice(rank * rows_per_rank, (rank + 1) * rows_per_rank)
        fsdp = None if kwargs is None else FSDP(**{"strategy": "zero3", **kwargs})
        t0 = time.perf_counter()
        jm = thunder.jit(model, transforms=[fsdp] if fsdp else [], executors=executors_for("cpu"))
        step = _step(jm, inputs[rows], targets[rows])
        step()  # the first call traces and compiles
        compiled.append((fsdp, step, _slowest(time.perf_counter() - t0)))
    best = [float("inf")] * len(compiled)
    for _ in range(steps):
        for i, (_, step, _) in enumerate(compiled):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            best[i] = min(best[i], _slowest(time.perf_counter() - t0))
    out = []
    for name, (fsdp, _, compile_s), step_s in zip(plans, compiled, best):
        if fsdp is None:
            units, stats = (), StepStats(world, (), 0)
        else:
            done = fsdp.compiled_step
            units, stats = tuple(u.name for u in done.plan.units), step_stats(done.forward, done.backward, world)
        auto = None if fsdp is None else fsdp.compiled_step.plan.auto
        out.append(UnitTiming(name, units, stats, step_s, compile_s, None if auto is None else str(auto)))
    return out


def _step(jm, x, y):
    opt = torch.optim.SGD(jm.parameters(), lr=0.01)

    def step():
        jm(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step
