"""``FSDP("auto")`` at compile time: plan the step from its functional forward trace, and turn the plan into
the options the other stages read, as if the user had written them.

``step_summary(computation, param_of_arg, model, options) -> StepSummary`` (every compile makes one: the step
model prices hand-written plans from it too, :mod:`fsdp_pass.cost.price_plan`), then
``plan_auto(summary, model, options) -> AutoPlan`` and ``options_of_auto_plan(plan, options) -> options``

1. The trace summarized into pieces (:mod:`fsdp_pass.cost.step_summary`).
2. Plan (:func:`~fsdp_pass.search.auto_plan.plan_step`) from the summary every rank plans from
   (:mod:`~fsdp_pass.search.planned_from`), with the settings' cost inputs, else the defaults of the device the step
   computes on (``h100-nvlink`` on CUDA, ``cpu-gloo`` otherwise), and the settings' budget, else the CUDA device's
   memory (no bound on the CPU or the meta device).
3. The plan's units become a unit policy (:class:`PlannedUnits`), its resharding a ``reshard_after_forward``
   function of the unit's name, its checkpointing a ``checkpoint_activations`` one (:class:`CheckpointNamed`,
   the level per unit), its prefetch depths (one for all, and the units' own) a
   :class:`~fsdp_pass.plan.schedule.Schedule`.

When the model is sharded, every rank takes rank 0's settings (:func:`agreed_settings`); at the first compile every
rank plans from the same step; later compiles keep the first one's plan (:mod:`~fsdp_pass.search.decisions`). Offload moves the shards when the model is sharded, before any trace exists: with ``offload_to``
given the plan offloads; without it, a plan that needs offload is an FSDPError saying to pass
``offload_to="cpu"``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.distributed as dist

from fsdp_pass.errors import fail
from fsdp_pass.search.auto_plan import plan_step
from fsdp_pass.search.auto_plan_text import AutoPlan
from fsdp_pass.cost.cost_model import device_defaults
from fsdp_pass.cost.fused_saves import fuses_elementwise
from fsdp_pass.plan.options import AutoSettings, FSDPOptions
from fsdp_pass.plan.plan_units import policy_input
from fsdp_pass.plan.schedule import Schedule
from fsdp_pass.cost.step_summary import StepSummary, summarize
from fsdp_pass.text import human_bytes
from fsdp_pass.ranks import has_peers


class PlannedUnits:
    """A unit policy that returns the auto plan's units (of the parameters the trace reads: a later compile keeps
    the first one's plan)."""

    name = "auto"

    def __init__(self, groups):
        self.planned = tuple(groups)

    def groups(self, inp) -> list:
        used = [(n, tuple(p for p in ps if p in inp.first_use)) for n, ps in self.planned]
        return [(n, ps) for n, ps in used if ps]


@dataclass(frozen=True)
class ReshardNamed:
    """``reshard_after_forward`` of the auto plan: the units it names reshard."""

    names: frozenset[str]

    def __call__(self, unit) -> bool:
        return unit.name in self.names


@dataclass(frozen=True)
class CheckpointNamed:
    """``checkpoint_activations`` of the auto plan: the level of each unit it names (the others: none)."""

    levels: tuple[tuple[str, str], ...]

    def __call__(self, unit) -> str:
        return dict(self.levels).get(unit.name, "none")


def agreed_settings(settings: AutoSettings, device, group) -> AutoSettings:
    """``settings`` with the device's defaults filled in, and rank 0's on every rank of ``group`` (collective): a
    plan is a function of these and of the step every rank plans from (:mod:`~fsdp_pass.search.planned_from`), so
    every rank plans the same collectives (the cost inputs of a probe, or a device's memory, could differ between
    ranks by a little)."""
    default_cost, default_budget = device_defaults(device)
    settings = replace(
        settings,
        cost=settings.cost or default_cost,
        memory_budget=settings.memory_budget if settings.memory_budget is not None else default_budget,
    )
    if has_peers(group):
        box = [settings]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        settings = box[0]
    return settings


# executors that run an attention as one kernel with a backward of their own (when their checker takes it:
# Thunder's sdpa wants CUDA tensors, cpu_attention CPU ones); Thunder's torch executor and the fusion executors
# decompose it
ATTENTION_KERNEL_EXECUTORS = ("sdpa", "cudnn", "nvfuser", "cpu_attention")


def fused_attention(executors):
    """``bsym -> bool``: whether an executor of ``executors`` (Thunder's executor list) runs that attention as one
    kernel, which keeps no b·h·s·s scores for the backward."""
    kernels = [ex for ex in executors or () if getattr(ex, "name", None) in ATTENTION_KERNEL_EXECUTORS]
    return lambda bsym: any(ex.can_execute(bsym) for ex in kernels)


def step_summary(computation, param_of_arg: dict[str, str], model, options: FSDPOptions, executors=()) -> StepSummary:
    """What the step model reads of the functional forward trace ``computation`` (for any plan, auto or not);
    ``executors``: the list it will be lowered with (which attentions run fused)."""
    inp, _ = policy_input(computation, param_of_arg, model.sharding, model.tree)
    optimizer = options.auto.optimizer if options.auto is not None else AutoSettings.optimizer
    return summarize(computation, inp, param_of_arg, model.sharding, options.mixed_precision, optimizer,
                     model.groups.replicas, fused_attention(executors), fuses_elementwise(executors))


def plan_auto(summary: StepSummary, model, options: FSDPOptions) -> AutoPlan:
    """The auto plan of the step ``summary`` (``options.auto`` set; its cost inputs and budget, else the defaults of
    the device the model computes on)."""
    settings = options.auto
    default_cost, default_budget = device_defaults(model.device)
    offloaded = options.offload_to is not None
    budget = settings.memory_budget if settings.memory_budget is not None else default_budget
    plan: AutoPlan = plan_step(summary, settings.cost or default_cost, budget, offload=True if offloaded else None)
    if plan.candidate.offload and not offloaded:
        fail(
            f"FSDP('auto', memory_budget={human_bytes(budget)}) fits only with offload: the shards, their gradients "
            "and the optimizer state must live on the host, and they are placed when the model is sharded.",
            "Pass offload_to='cpu' too (FSDP('auto', memory_budget=..., offload_to='cpu')), or a larger budget.",
        )
    return plan


def options_of_auto_plan(plan: AutoPlan, options: FSDPOptions) -> FSDPOptions:
    """The options the auto ``plan`` makes of ``options``, as if the user had written them."""
    return replace(
        options,
        unit_policy=PlannedUnits(plan.groups),
        reshard_after_forward=ReshardNamed(plan.resharded),
        checkpoint_activations=CheckpointNamed(tuple(sorted(plan.checkpoint_by_unit.items()))),
        schedule=Schedule(prefetch=plan.candidate.prefetch, prefetch_by_unit=plan.prefetch_by_unit),
    )
