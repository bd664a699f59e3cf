"""The stage order of FSDP, written once: the transform and the functional (tutorial) path both run it.

Before Thunder's autodiff, on the functional forward trace: :func:`rewrite_forward`

  0. inputs    an integer input the step uses where torch takes int64 only is an FSDPError naming it, before
               anything is compiled (:func:`~fsdp_pass.shard.index_inputs.check_index_inputs`; the inputs' devices
               and the failures of tracing are checked where the call enters, :mod:`fsdp_pass.shard.input_checks`);
               an in-place op a gradient flows through computes from a copy of the tensor it writes, which Thunder's
               backward would otherwise read overwritten
               (:func:`~fsdp_pass.passes.copy_before_in_place.copy_before_in_place`);
  1. plan      which parameters are gathered together, which units reshard after forward, which are
               checkpointed (:func:`~fsdp_pass.plan.plan_units.plan_units`); under ``FSDP("auto")`` the
               auto planner chooses the units, their resharding and the prefetch depth first, with ``units=``
               left out the step model chooses the units (:func:`~fsdp_pass.search.decisions.decided_options`).
               Every decision reads the step summary every rank plans from, agreed at the model's first compile
               (:mod:`~fsdp_pass.search.planned_from`: one collective there, where the group has peers) and kept
               with the first plan for later compiles; the plan keeps its own trace's summary too
               (``plan.summary``, what :mod:`~fsdp_pass.cost.price_plan` prices);
  2. shard     the prologue expects the shards (:func:`~fsdp_pass.shard.prologue.shard_prologue`); the
               module itself was sharded once, when the transform was applied (:mod:`fsdp_pass.shard.module`);
  3. insert    one ``unshard_unit`` per unit before its first use
               (:func:`~fsdp_pass.passes.insert_unshards.insert_unshards`), the outputs cast to mixed
               precision's ``output_dtype`` (:func:`~fsdp_pass.passes.cast_compute.cast_compute`; Thunder traced
               the module in its ``param_dtype`` already), the activation checkpointing tags
               (:func:`~fsdp_pass.passes.checkpoint_units.checkpoint_units`).

  4. Thunder derives the backward from ``unshard_unit``'s gradient rule (:mod:`fsdp_pass.ops.unshard`:
     the reduce-scatters) and lowers both traces onto the executors.

After lowering, on the final forward and on the final backward trace: :func:`finish_lowered`

  5. schedule  prefetched gathers, late waits, early reduce-scatters
               (:func:`~fsdp_pass.passes.schedule_collectives.schedule_collectives`);
  6. verify    no buffer used while its collective is in flight; the forward's first collective comes with a
               check that every rank runs a step with the same collectives, at every step (issued beside it,
               awaited before the second: :mod:`fsdp_pass.verify.step_agreement`); with
               ``FSDP(check_finite=True)`` each unit's parameters and gradients (one flag per parameter) and each
               block's output are checked for NaN/inf, and the forward and the backward each end with every
               rank's verdict
               (:func:`~fsdp_pass.passes.insert_finite_checks.insert_finite_checks`);
  7. label     every collective and the ops around it named with its unit and bytes
               (:func:`~fsdp_pass.passes.label_collectives.annotate_collectives`), and the forward's copies made for
               in-place ops (:func:`~fsdp_pass.passes.copy_before_in_place.label_copies`).

:func:`reschedule` runs stages 5-7 again, with another schedule, on the lowered traces a compile kept: what
compiling with that schedule gives, without compiling.
"""

from __future__ import annotations

from dataclasses import replace

from fsdp_pass.compiled_step import PHASES, CompiledStep
from fsdp_pass.op_names import ALL_GATHER
from fsdp_pass.ops.grad_accumulation import REDUCE
from fsdp_pass.passes.cast_compute import cast_compute
from fsdp_pass.passes.checkpoint_units import checkpoint_units
from fsdp_pass.passes.copy_before_in_place import copy_before_in_place, label_copies
from fsdp_pass.passes.collective_groups import gathered_parameters
from fsdp_pass.passes.insert_finite_checks import insert_finite_checks
from fsdp_pass.passes.insert_unshards import insert_unshards
from fsdp_pass.passes.label_collectives import annotate_collectives
from fsdp_pass.passes.schedule_collectives import schedule_collectives
from fsdp_pass.passes.units_of_collectives import units_of_collectives
from fsdp_pass.search.auto_options import step_summary
from fsdp_pass.search.decisions import decided_options
from fsdp_pass.plan.options import FSDPOptions
from fsdp_pass.plan.plan_units import plan_units
from fsdp_pass.search.planned_from import agree_on_step
from fsdp_pass.plan.schedule import Schedule, resolve_schedule
from fsdp_pass.plan.trace_arguments import parameter_names_of_args
from fsdp_pass.plan.units import UnitPlan
from fsdp_pass.ranks import has_peers
from fsdp_pass.shard.index_inputs import check_index_inputs
from fsdp_pass.shard.module import ShardedModel
from fsdp_pass.shard.prologue import shard_prologue
from fsdp_pass.verify.collective_lifetimes import check_collective_lifetimes
from fsdp_pass.verify.rank_differences import plan_lines
from fsdp_pass.verify.same_collectives_on_all_ranks import (
    insert_step_check,
    record_step_collectives,
)


def rewrite_forward(prologue, computation, model: ShardedModel, options: FSDPOptions, grad_sync=(REDUCE, None),
                    executors=(), argument_names: tuple[str, ...] = (), first: UnitPlan | None = None):
    """Stages 1-3 on Thunder's prologue and functional forward trace: ``(prologue, computation, plan, options)``,
    the last the options the plan was made with (the auto plan's, under ``FSDP("auto")``; else ``options``).

    ``grad_sync``: ``(mode, accumulators)``, the gradient-sync mode of :mod:`fsdp_pass.ops.grad_accumulation`
    this compile is for (``accumulators`` None: no ``no_sync`` check in the prologue); ``executors``: Thunder's
    executor list for this compile (the step summary reads which attentions run fused); ``argument_names``: the
    forward's positional parameter names (for the errors of stage 0); ``first``: the plan of the model's first
    compile, whose decisions a later compile keeps (None: this is the first, and every rank of the model makes it:
    the ranks agree on the step they plan from here).
    """
    check_index_inputs(prologue, computation, argument_names)
    computation = copy_before_in_place(computation)
    param_of_arg = parameter_names_of_args(prologue, computation)
    summary = step_summary(computation, param_of_arg, model, options, executors)
    planned_from = first.planned_from if first is not None else agree_on_step(summary, model.groups.everyone)
    options, auto, choice = decided_options(planned_from, model, options, first)
    plan = plan_units(computation, param_of_arg, model.sharding, options, model.tree, planned_from.summary)
    plan = replace(plan, auto=auto, summary=summary, units_choice=choice, planned_from=planned_from)
    prologue = shard_prologue(prologue, model.sharding, model.placed_on, grad_sync)
    offloaded = options.offload_to is not None
    computation = insert_unshards(
        computation,
        plan,
        model.group,
        precision=options.mixed_precision,
        compute_device=str(model.device) if offloaded else None,
        shard_device=str(model.shard_device) if offloaded else None,
        grad_sync=grad_sync,
        replicate_group=model.groups.replicate,
    )
    computation = cast_compute(computation, options.mixed_precision)
    computation = checkpoint_units(computation, plan)
    return prologue, computation, plan, options


def finish_lowered(trace, phase: str, plan: UnitPlan, options: FSDPOptions, group=None, step_key: str | None = None,
                   scope: str = "", forward=None):
    """Stages 5-7 on a final ``phase`` (``"forward"`` or ``"backward"``) trace: ``(trace, unit_of_collective)``,
    the second mapping each collective's output name to its unit's name. ``forward``: for the backward, the
    final forward trace (the gathered parameters it keeps for the backward: the backward's first prefetched
    gather waits for their first use, not for the loss's gradient above it). ``step_key``: the compile's
    :attr:`~fsdp_pass.compiled_step.CompiledStep.key`, under which its collectives are kept for the per-step
    check (None: no check); ``scope``: the model's name, the same on every rank (its variants' checks agree
    among themselves)."""
    found = units_of_collectives(trace, plan)
    if options.schedule is not None:
        kept = frozenset(  # gathers whose units stay gathered for the backward
            name
            for name, (unit, kind) in found.items()
            if phase == "forward" and kind is ALL_GATHER and not unit.reshard_after_forward
        )
        unit_of = {name: unit.name for name, (unit, _) in found.items()}
        received = gathered_parameters(forward) if phase == "backward" and forward is not None else frozenset()
        trace = schedule_collectives(trace, options.schedule, kept, unit_of, received, backward=phase == "backward")
    check_collective_lifetimes(trace)
    if options.check_finite and step_key is not None:
        trace = insert_finite_checks(trace, phase, plan, group, step_key, scope)
    if options.verify_ranks and step_key is not None and has_peers(group):
        record_step_collectives(step_key, group, phase, trace, found, scope, plan_lines(plan, options))
        if phase == "forward":
            trace = insert_step_check(trace, step_key)
    trace = annotate_collectives(trace, plan, found)
    if phase == "forward":
        trace = label_copies(trace)
    return trace, {name: unit.name for name, (unit, _) in found.items()}


def reschedule(step: CompiledStep, schedule: Schedule | int | None) -> CompiledStep:
    """Stages 5-7 again on ``step``'s lowered traces, with another ``schedule``: the step that compiling with
    ``FSDP(..., schedule=schedule)`` gives (stages 1-4 do not read the schedule), without compiling. Nothing
    runs and no other rank is asked: the cross-rank check and the finite checks are left out."""
    options = replace(step.options, schedule=resolve_schedule(schedule), verify_ranks=False)
    out = CompiledStep(step.plan, options)
    for phase in PHASES:
        if step.lowered.get(phase) is not None:
            trace, units = finish_lowered(step.lowered[phase], phase, step.plan, options, forward=out.forward)
            out = out.with_final_trace(phase, trace, units, lowered=step.lowered[phase])
    return out
