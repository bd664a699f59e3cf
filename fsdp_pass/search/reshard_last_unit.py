"""Search step after :func:`~fsdp_pass.plan.plan_units.plan_units`: whether ZeRO-3's last unit stays gathered.

``reshard_last_unit(plan, options, computation, summary) -> plan``. ``plan_units`` reshards every ZeRO-3 unit after
its forward; the last one the forward gathers stays gathered into the backward unless the step model predicts a
lower step peak for resharding it (:mod:`~fsdp_pass.search.last_unit`; a tie keeps it: a gather saved), priced on
the step summary every rank plans from (``summary``: :mod:`~fsdp_pass.search.planned_from`). Where the model
cannot price the units (no summary, a unit that splits a piece, a schedule it does not follow) a byte rule decides
(:func:`keeps_last_unit`): the last unit reshards where what the forward computes after its last use (the
summary's :func:`~fsdp_pass.plan.computed_after.bytes_after_last_read`) outgrows it. A ``reshard_after_forward``
the user gave decides instead (this step leaves the plan as it is). The decision's reason joins the plan's notes.
"""

from __future__ import annotations

from dataclasses import replace

from fsdp_pass.cost.candidate_costs import Candidate
from fsdp_pass.cost.step_summary import StepSummary
from fsdp_pass.plan.computed_after import compute_after
from fsdp_pass.plan.options import FSDPOptions
from fsdp_pass.plan.sharding import Strategy
from fsdp_pass.plan.units import Unit, UnitPlan
from fsdp_pass.search.last_unit import last_unit, starts_of
from fsdp_pass.text import human_bytes


def reshard_last_unit(plan: UnitPlan, options: FSDPOptions, computation, summary: StepSummary | None) -> UnitPlan:
    """``plan`` with ZeRO-3's last unit kept gathered or resharded, and why in its notes (unchanged under
    ZeRO-2, without units, or where the user gave ``reshard_after_forward``)."""
    if options.reshard_after_forward is not None or plan.sharding.strategy is not Strategy.ZERO3 or not plan.units:
        return plan
    units, notes = list(plan.units), list(plan.notes)
    template = _priced_template(units, options, [u.checkpoint for u in units], summary)
    if template is not None:
        decided = last_unit(summary, template, [u.name for u in units])
        reshards = decided.reshards
        verdict = ("reshards after forward although the forward gathers it last" if reshards
                   else "stays gathered after forward")
        notes.append(f"unit {units[-1].name!r} {verdict}: {decided.why()}")
    else:
        reshards = _last_unit_by_bytes(units, plan.sharding, options, computation, summary, notes)
    units[-1] = replace(units[-1], reshard_after_forward=reshards)
    return replace(plan, units=tuple(units), notes=tuple(notes))


def keeps_last_unit(after_bytes: int, unit_bytes: int) -> bool:
    """ZeRO-3's rule for the last unit the forward gathers where the step model cannot price the units
    (``reshard_after_forward=None``; else :mod:`~fsdp_pass.search.last_unit` decides): keep it gathered into
    the backward unless what the forward computes after its last use (``after_bytes``, :func:`~fsdp_pass.plan.computed_after.compute_after`: a
    loss computed inside the model; and a loss the caller computes on the outputs, :func:`caller_loss_bytes`)
    outgrows the unit (``unit_bytes``, gathered). The backward starts with those
    ops' gradients, about as large as their results; where they are larger than the unit, the step peaks there
    and a kept unit adds its bytes to that peak, so it reshards and is gathered again before its first use. Where
    they are not (nothing after it; a small loss such as a mean squared error), the unit's own backward holds as
    much (the unit and its gradients), so keeping it raises no peak and saves a gather."""
    return after_bytes <= unit_bytes


def _what_follows(after: list[str], after_bytes: int, loss_bytes: int) -> str:
    """The plan note's words for what the backward differentiates before the last unit's first use."""
    shown = list(dict.fromkeys(after))
    ops = f"{', '.join(shown[:4])}{', ...' if len(shown) > 4 else ''}"
    parts = [f"what computes after its last use ({ops}, {human_bytes(after_bytes)})"] if after else []
    if loss_bytes:
        parts.append("the loss the caller computes on the returned outputs (taken to be a cross-entropy, as the "
                     f"memory model prices it: log-probabilities and their gradient, {human_bytes(loss_bytes)})")
    total = f" ({human_bytes(after_bytes + loss_bytes)} together)" if len(parts) > 1 else ""
    return " and ".join(parts) + total


def _priced_template(units: list[Unit], options: FSDPOptions, levels: list[str], summary):
    """``units`` as the step model's candidate over ``summary``'s pieces (its resharding left to decide), or None
    where the model cannot price them: no summary, a unit that is not a run of whole pieces, a schedule that is not
    prefetch depths with the kept units first."""
    s = options.schedule
    if summary is None or s is None or s.max_unused_bytes is not None or not s.kept_units_first:
        return None
    starts = starts_of(summary, [u.params for u in units])
    if starts is None:
        return None
    own = dict(s.prefetch_by_unit)
    depths = tuple(own.get(u.name, s.prefetch) for u in units)
    return Candidate(starts, (True,) * len(units), s.prefetch, options.offload_to is not None,
                     depths if any(d != s.prefetch for d in depths) else (),
                     tuple(levels) if any(lv != "none" for lv in levels) else ())


def _last_unit_by_bytes(units, sharding, options, computation, summary, notes) -> bool:
    """The rule where the step model cannot price the units (:func:`keeps_last_unit`): whether the last unit
    reshards, with its note. Its bytes are the ``summary``'s (the step every rank plans from) where it has one, the
    op names this trace's."""
    last = units[-1]
    after, after_bytes = compute_after(computation, last.last_use)
    planned = summary.bytes_after(last.params) if summary is not None else None
    after_bytes = after_bytes if planned is None else planned
    loss_bytes = summary.loss_bytes if summary is not None else 0
    gathered_dtype = getattr(options.mixed_precision, "param_dtype", None)  # as the step summary counts it
    unit_bytes = sum(sharding.param(p).nbytes(gathered_dtype) for p in last.params)
    keep_last = keeps_last_unit(after_bytes + loss_bytes, unit_bytes)
    follows = _what_follows(after, after_bytes, loss_bytes)
    if keep_last and not follows:
        notes.append(f"unit {last.name!r} stays gathered after forward: nothing computes after its last use, "
                     "so the backward needs it first")
    elif keep_last:
        notes.append(f"unit {last.name!r} stays gathered after forward: {follows} is no larger than the unit "
                     f"({human_bytes(unit_bytes)}), so the backward's peak is not above it")
    else:
        notes.append(
            f"unit {last.name!r} reshards after forward although the forward gathers it last: {follows} "
            f"outgrows the unit ({human_bytes(unit_bytes)}); the backward starts with their gradients, "
            "without the unit, and gathers it again before its first use"
        )
    return not keep_last
