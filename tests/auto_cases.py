"""``FSDP("auto")`` on every rank of a gloo RankPool (module-level so spawned ranks can import them)."""

from __future__ import annotations

from dataclasses import replace

import torch.distributed as dist

from fsdp_pass.search.auto_plan import smallest_peak
from fsdp_pass.cost.cost_model import DEFAULTS, LinkCost
from tests import models, rank_cases


def auto_parity(model_name: str, steps: int = 3):
    """Plan without a budget, then train with a budget halfway between the smallest peak any plan reaches and
    that plan's (without checkpointing): the planner must change the plan to fit, and the step must still equal one process's."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # each rank is given other cost inputs (rank 1 a link 100x slower, which would merge every unit): every rank
    # must plan with rank 0's, or their collectives would differ
    own = DEFAULTS["cpu-gloo"]
    own = replace(own, link=LinkCost(own.link.alpha_s * (1 + 99 * rank), own.link.bytes_per_s), source=f"rank {rank}")
    _, jm, fsdp = rank_cases._reference_and_fsdp_model(model_name, "auto", cost=own)
    x, y = models.batch(model_name, 2 * world_size, 0)
    n = x.shape[0] // world_size
    models.loss_fn(model_name, jm(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()
    free = fsdp.unit_plan
    cost = DEFAULTS["cpu-gloo"]
    budget = (smallest_peak(free.auto.summary, cost, offload=False, checkpoint=False).peak_bytes
              + free.auto.prediction.peak_bytes) // 2
    out = rank_cases.parity(model_name, "auto", steps=steps, keep_model=True, cost="cpu-gloo", memory_budget=budget,
                            measure_step=True)
    auto = rank_cases.fsdp_of(out.pop("jm")).unit_plan.auto
    return out | {
        "budget": budget,
        "predicted_peak": auto.prediction.peak_bytes,
        "unbounded_peak": free.auto.prediction.peak_bytes,
        "unbounded_units": [u.name for u in free.units],
        "unbounded_reshard": [u.reshard_after_forward for u in free.units],
        "unbounded_cost_source": free.auto.cost.source,
        # the smallest peaks any plan of this step reaches without and with activation checkpointing (for
        # test_a_budget_that_needs_checkpointing_is_met_on_gloo_ranks's budget, between the two)
        "smallest_peaks": {c: smallest_peak(free.auto.summary, cost, offload=False, checkpoint=c).peak_bytes
                           for c in (False, True)},
    }


def auto_checkpointed(model_name: str, budget: int, steps: int = 2):
    """Train ``FSDP("auto", memory_budget=budget)`` against one process, a budget no plan fits without activation
    checkpointing, and measure one more step: the plan's checkpointed units and the measured peak."""
    out = rank_cases.parity(model_name, "auto", steps=steps, keep_model=True, cost="cpu-gloo", memory_budget=budget,
                            measure_step=True)
    plan = rank_cases.fsdp_of(out.pop("jm")).unit_plan
    return out | {
        "budget": budget,
        "predicted_peak": plan.auto.prediction.peak_bytes,
        "checkpoint": {u.name: u.checkpoint for u in plan.units if u.checkpointed},
    }
