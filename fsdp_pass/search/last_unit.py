"""ZeRO-3's last unit, decided by the step model: ``last_unit(summary, template) -> LastUnit``.

ZeRO-3 reshards every unit after its forward but the last one the forward gathers: the backward starts with that
unit, so freeing it would mean gathering it again at once. Keeping it gathered costs its bytes wherever the step
peaks while it is held, though: a loss the caller computes on the returned logits runs before the backward, with
the kept unit beside its log-probabilities and their gradient (the step model's point "the caller's loss").

So the step model (:func:`~fsdp_pass.cost.step_model.peak_of`) prices both: the candidate ``template`` (its units,
prefetch depths, offload, checkpointing; its ``reshard`` is ignored) with every unit resharded, and with the last
one kept. The last unit reshards only where that lowers the predicted step peak by more than the model's error
(``TIE``: 1 % of the kept peak; on the Llamas it was measured on the model is within 0.3 % of the traces, on tiny
models a few hundred bytes off); a tie keeps it (a gather saved).
Over a group of one rank a gather is the shards themselves (:func:`~fsdp_pass.plan.gather_rules.gathers_nothing`): both
choices hold the same bytes and the last unit stays.

``plan_units``, the default units (:mod:`~fsdp_pass.search.default_units`) and the auto planner's hand-written ZeRO-3
(:mod:`~fsdp_pass.search.auto_plan`) ask this one function, so what they price is what the compile does.
``reshard_after_forward=`` given by the user overrides it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fsdp_pass.cost.candidate_costs import Candidate, unit_costs
from fsdp_pass.cost.cost_model import DEFAULTS
from fsdp_pass.cost.step_model import peak_of, persistent_bytes
from fsdp_pass.cost.step_summary import StepSummary
from fsdp_pass.text import human_bytes

_BYTES_ONLY = DEFAULTS["cpu-gloo"]  # the peak reads no rate: any cost inputs price it the same
TIE = 0.01  # a predicted saving under this share of the kept peak is within the step model's error: kept


@dataclass(frozen=True)
class LastUnit:
    """Both choices for the last unit, as the step model predicts their step peaks, and the one taken."""

    kept_peak: int
    kept_at: str
    resharded_peak: int
    resharded_at: str
    views: bool = False  # the gathers are the shards' views (one rank): keeping saves no gather, only ops

    @property
    def ties(self) -> bool:
        """Resharding saves no more than the step model's error (``TIE`` of the kept peak)."""
        return self.kept_peak - self.resharded_peak <= TIE * self.kept_peak

    @property
    def reshards(self) -> bool:
        """Resharding lowers the predicted step peak by more than the model's error."""
        return not self.ties

    def flags(self, k: int) -> tuple[bool, ...]:
        """Every one of ``k`` units reshards, the last one as decided."""
        return (True,) * (k - 1) + (self.reshards,) if k else ()

    def why(self) -> str:
        """The plan note's reason, with both predictions."""
        saved = "kept (one rank: its gather is its shards' views either way)" if self.views else "kept, a gather saved"
        kept = f"{human_bytes(self.kept_peak)} ({self.kept_at})"
        resharded = f"{human_bytes(self.resharded_peak)} ({self.resharded_at})"
        if self.kept_peak == self.resharded_peak:
            return f"the step model predicts the same step peak either way, {kept}: {saved}"
        if self.resharded_peak > self.kept_peak:
            return f"the step model predicts no lower step peak resharding it: {kept} kept, {resharded} resharded"
        if self.ties:
            return (f"the step model predicts about the same step peak either way (within {TIE:.0%}, its error): "
                    f"{kept} kept, {resharded} resharded: {saved}")
        return f"the step model predicts a lower step peak resharding it: {resharded} against {kept} kept"


def last_unit(summary: StepSummary, template: Candidate, names: list[str] | None = None) -> LastUnit:
    """The step model's two step peaks for the units of ``template`` (named ``names`` where the peaks are placed):
    every unit resharded, or all but the last."""
    k = len(template.starts)
    units = unit_costs(summary, template, _BYTES_ONLY)  # what they cost does not depend on the resharding
    names = list(names) if names is not None else [summary.pieces[s].name for s in template.starts]
    persistent = persistent_bytes(summary, template.offload)

    def peak(reshard):
        return peak_of(units, replace(template, reshard=reshard), names, persistent, summary.output_bytes,
                       summary.loss_bytes)

    kept, resharded = peak((True,) * (k - 1) + (False,)), peak((True,) * k)
    return LastUnit(kept[0], kept[1], resharded[0], resharded[1], summary.gathers_views)


def zero3_reshards(summary: StepSummary, template: Candidate) -> tuple[bool, ...]:
    """ZeRO-3's resharding of ``template``'s units: every unit, the last one where the step model predicts a step
    peak lower by more than its error (``TIE``) for it (:func:`last_unit`)."""
    k = len(template.starts)
    return last_unit(summary, template).flags(k) if k else ()


def starts_of(summary: StepSummary, unit_params: list[tuple[str, ...]]) -> tuple[int, ...] | None:
    """The summary's piece index where each unit (its parameters, in forward order) starts, where every unit is a
    run of whole consecutive pieces; None where one is not (a unit that splits a piece: the step model cannot
    price it)."""
    unit_of = {p: i for i, ps in enumerate(unit_params) for p in ps}
    starts, seen = [], -1
    for i, piece in enumerate(summary.pieces):
        owners = {unit_of.get(p) for p in piece.params}
        if len(owners) != 1 or None in owners:
            return None
        (u,) = owners
        if u != seen:
            if u != seen + 1:
                return None
            starts.append(i)
            seen = u
    return tuple(starts) if seen == len(unit_params) - 1 else None
