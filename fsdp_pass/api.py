"""What a user calls on a model jitted with ``FSDP``: each function finds the model's transform and hands
its parts to the stage that does the work.

- ``fsdp_of(jm)``: the :class:`~fsdp_pass.transform.FSDP` transform ``jm`` was jitted with;
- ``explain(jm | fsdp | plan)``: :mod:`fsdp_pass.report.explain` of the latest compile (or of a plan alone);
- ``predict_step(jm, cost=...)``: the auto planner's step model on the latest compile's plan
  (:mod:`fsdp_pass.cost.price_plan`);
- ``no_sync(jm)``: accumulate gradients without reduce-scatters (:mod:`fsdp_pass.ops.grad_accumulation`);
- ``full_state_dict(jm)``, ``load_full_state_dict(jm, sd)``: :mod:`fsdp_pass.shard.state_dict` (the
  sharded forms, optimizers and checkpoint folders: :mod:`fsdp_pass.train`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from fsdp_pass.errors import fail
from fsdp_pass.cost.step_model import Prediction
from fsdp_pass.plan.units import UnitPlan
from fsdp_pass.report.explain import Explanation, explain_plan
from fsdp_pass.shard import state_dict
from fsdp_pass.transform import FSDP


def fsdp_of(jitted) -> FSDP:
    """The :class:`FSDP` transform a model was jitted with (an error saying what to pass otherwise)."""
    for t in getattr(jitted, "_lc_transforms", ()):
        if isinstance(t, FSDP):
            return t
    fail(
        f"This model ({type(jitted).__name__}) was not compiled with fsdp_pass.FSDP.",
        "Pass the model returned by thunder.jit(model, transforms=[FSDP(...)]).",
    )


def arrived(jitted, what: str) -> FSDP:
    """The :class:`FSDP` transform of ``jitted``, once every rank of its group has called the collective helper
    ``what`` (an FSDPError naming the ranks that did not, after ``FSDP(timeout=...)``)."""
    fsdp = fsdp_of(jitted)
    fsdp.arrive(what)
    return fsdp


def explain(target, *, optimizer="adam") -> Explanation:
    """Explain a model jitted with :class:`~fsdp_pass.FSDP` (after its first step), an ``FSDP``
    transform, or a :class:`~fsdp_pass.plan.units.UnitPlan`.

    ``optimizer``: for the optimizer-state estimate, ``"adam"`` (2 parameter-sized states per
    trainable element), ``"sgd_momentum"`` (1), ``"sgd"`` (0), or a number of states.
    """
    if isinstance(target, UnitPlan):
        return explain_plan(target, optimizer=optimizer)
    fsdp = target if isinstance(target, FSDP) else fsdp_of(target)
    return fsdp.explain(optimizer)


def predict_step(target, *, cost=None) -> Prediction:
    """What the auto planner's step model predicts for the plan of a model jitted with :class:`~fsdp_pass.FSDP`
    (after its first step) or of an ``FSDP`` transform: the step time (compute, optimizer, exposed
    communication) and the peak per rank, as ``FSDP("auto")`` predicts its own plans, so a hand-written plan can
    be set beside the auto plan or a measured step (:mod:`fsdp_pass.cost.price_plan`).

    ``cost``: a ``fsdp_pass.cost.cost_model.DEFAULTS`` name (``"h100-nvlink"``, ``"cpu-gloo"``), ``CostInputs``,
    or ``fsdp_pass.cost.probe.probe()``'s result; None: what ``FSDP("auto")`` planned with, else the defaults of the
    device the step computes on. The optimizer is taken to be AdamW. A plan the model cannot describe
    (per-parameter units, checkpointed units) is an FSDPError saying why.
    """
    fsdp = target if isinstance(target, FSDP) else fsdp_of(target)
    return fsdp.predict_step(cost)


@contextmanager
def no_sync(jitted):
    """Accumulate gradients locally (no reduce-scatter) for the backwards of forwards run in this block.

    The first forward+backward after the block reduce-scatters the sum of everything accumulated.
    """
    with fsdp_of(jitted).accumulators.accumulating(jitted.parameters()):
        yield


def full_state_dict(jitted, *, cpu: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded state dict (same keys as the original module's), on every rank: collective.
    (``get_model_state_dict`` with ``StateDictOptions(full_state_dict=True, cpu_offload=True)`` keeps it on
    rank 0 only.)"""
    full = state_dict.model_state_dict(jitted, arrived(jitted, "full_state_dict()").model, full=True)
    return {k: v.cpu() for k, v in full.items()} if cpu else full


def load_full_state_dict(jitted, full: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Shard a full state dict into the model's existing parameters (every rank calls it: collective)."""
    fsdp = arrived(jitted, "load_full_state_dict()")
    state_dict.load_model_state_dict(jitted, fsdp.model, full, form="full", strict=strict)
