"""What FSDP does to a model, unit by unit, and what it costs each rank per step.

``explain_step(compiled_step) -> Explanation`` (what ``fsdp_pass.explain(jitted_model)`` returns after one
training step, or a dry run) prints

1. per unit: its parameters, numel, sharded and unsharded bytes, padding, whether it is resharded
   after forward, and for each of its collectives (forward all-gather, backward all-gather,
   reduce-scatter) where it is issued and waited in the final trace (op positions) and the compute
   that runs in between (estimated MFLOP; ``EXPOSED`` when none); under the table the plan's notes
   (``note: ...``), such as why ZeRO-3's last unit stays gathered into the backward or reshards;
2. per rank and step: bytes sent against the floor no ZeRO scheme can go below;
3. per rank: predicted peak memory = sharded parameters + optimizer state + the step's peak (from the
   traces, :mod:`fsdp_pass.report.memory`), the op where the step peaks, and the step's peak split by kind
   (gathered parameters, activations saved for the backward, unsharded gradients and their packed buffers,
   gradient shards, everything else); the lines add up to the peak. With ``offload_to`` the shards, their
   gradients and the optimizer state are counted on the host, not the device. Then the most gathered
   parameter memory live at once, where, and of what: whole gathered buffers and the parameters copied out
   of them (both live while a unit is cut out, so it can exceed the model's parameters);
4. under the header, the options the user set: mixed precision, offload, checkpointed units (nothing when
   none is);
5. notes, only where they apply: what :func:`fsdp_pass.no_sync`'s accumulators hold, when the compile was
   made under ``no_sync`` (its backward accumulates or flushes) or when asked for with
   :meth:`Explanation.with_no_sync`; how to clip gradients, when there is more than one rank.

``explain_plan(plan)`` on a :class:`~fsdp_pass.plan.units.UnitPlan` alone gives the sizes and the floors:
the schedule and the step's memory need the traces.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from fsdp_pass.compiled_step import CompiledStep
from fsdp_pass.errors import fail
from fsdp_pass.op_names import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from fsdp_pass.passes.units_of_collectives import units_of_collectives
from fsdp_pass.plan.mixed_precision import FULL_PRECISION, MixedPrecision
from fsdp_pass.plan.options import FSDPOptions
from fsdp_pass.plan.sharding import Strategy
from fsdp_pass.plan.units import UnitPlan
from fsdp_pass.predicates import is_grad_accumulation
from fsdp_pass.report.memory import (
    GATHERED,
    GRAD_SHARDS,
    GRADIENTS,
    OTHER,
    SAVED,
    GatheredPeak,
    StepMemory,
    step_memory,
)
from fsdp_pass.report.overlap import CollectiveOverlap, step_overlap
from fsdp_pass.report.step_stats import StepStats, floor_bytes, step_stats
from fsdp_pass.text import format_table, human_bytes

OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1, "sgd-momentum": 1, "none": 0}


@dataclass(frozen=True)
class UnitRow:
    name: str
    params: tuple[str, ...]
    numel: int
    shard_bytes: int  # per rank
    unsharded_bytes: int
    padding: int  # elements
    reshard_after_forward: bool
    checkpointed: bool = False  # activations recomputed in the backward
    forward_gathers: tuple[CollectiveOverlap, ...] = ()
    backward_gathers: tuple[CollectiveOverlap, ...] = ()
    reduce_scatters: tuple[CollectiveOverlap, ...] = ()


_SCALAR_OUTPUTS = 1024  # bytes of outputs' gradients below which the model returns its loss (nothing to note)


@dataclass(frozen=True)
class MemoryPrediction:
    """Per-rank bytes. ``peak`` = sharded parameters + optimizer state + the step's peak."""

    sharded_params: int
    optimizer_state: int
    optimizer_states_per_element: int
    gradient_shards: int  # allocated in the backward (part of the step's peak), kept until zero_grad
    step: StepMemory | None  # None: explained from a plan, without traces
    offloaded_to: str | None = None  # where shards, gradient shards and optimizer state live, if not the device
    accumulator_bytes: int = 0  # unsharded gradients held while accumulating under no_sync
    gathered: GatheredPeak | None = None  # the most gathered parameter memory live at once (None: no traces)
    unit_of_collective: dict = field(default_factory=dict)  # collective output name -> unit name

    @property
    def before_step(self) -> int:
        """What stays on the device between steps (nothing of it when offloaded)."""
        return 0 if self.offloaded_to else self.sharded_params + self.optimizer_state

    @property
    def host(self) -> int:
        """Bytes kept on the offload device: shards, their gradients and the optimizer state."""
        return self.sharded_params + self.optimizer_state + self.gradient_shards if self.offloaded_to else 0

    @property
    def peak(self) -> int | None:
        return None if self.step is None else self.before_step + self.step.peak_bytes


@dataclass(frozen=True)
class Explanation:
    plan: UnitPlan
    units: tuple[UnitRow, ...]
    memory: MemoryPrediction
    stats: StepStats | None  # the collectives of the traces; None for a plan alone
    param_bytes: int  # all parameters, unsharded
    options: tuple[str, ...] = ()  # one line per option the user set (mixed precision, offload, checkpointing)
    no_sync: bool = False  # show what no_sync()'s accumulators hold (the compile was made under no_sync, or asked)
    # all parameters as the gathers send them and as reduced (mixed precision's param_dtype, an 8-bit gather's codes
    # and scales, and reduce_dtype; None: param_bytes)
    gathered_param_bytes: int | None = None
    reduced_param_bytes: int | None = None
    gather_dtype: object = None  # mixed precision's 8-bit gather dtype (torch.int8, torch.float8_e4m3fn), or None
    held_param_bytes: int | None = None  # all parameters as held once gathered (dequantized: in the compute dtype)

    def with_no_sync(self) -> Explanation:
        """This explanation with a note of what :func:`fsdp_pass.no_sync`'s accumulators would hold per rank
        (shown without asking only when the compile was made under ``no_sync``)."""
        return replace(self, no_sync=True)

    @property
    def notes(self) -> tuple[str, ...]:
        """One line per note that applies: no_sync's accumulators (see :attr:`no_sync`), a loss outside the model
        (the backward receives a non-scalar output's gradient, and the model returns no scalar loss), 8-bit gathers
        on one rank (which send nothing), clipping (world > 1)."""
        notes = [self._accumulator_note()] if self.no_sync else []
        step = self.memory.step
        if step is not None and step.output_grad_bytes > _SCALAR_OUTPUTS and not step.returns_a_loss:
            notes.append(
                f"loss outside the model: the backward receives the gradient of {human_bytes(step.output_grad_bytes)} "
                "of outputs; the loss computed from them outside the model is taken to be a cross-entropy on the "
                f"logits, whose own backward holds {human_bytes(step.caller_loss_bytes)} more (two tensors that size) "
                "at the backward's start, which no trace here shows (both in the peak above): return the loss from "
                "the model to have it traced and planned"
            )
        if self.gather_dtype is not None and self.world_size == 1:
            notes.append(
                f"8-bit gathers on one rank: nothing is sent, so gathering in {str(self.gather_dtype).removeprefix('torch.')} "
                "saves no bytes and costs the quantize and dequantize kernels and their rounding (on an H200, "
                "BENCHMARKS.md: 1.33x the step); leave MixedPrecision's gather_dtype out where the shards' group is one rank"
            )
        if self.world_size > 1:
            notes.append(
                "clipping: fsdp_pass.clip_grad_norm_(model, max_norm) clips by the whole model's norm; "
                "torch.nn.utils.clip_grad_norm_ would see only this rank's shards (a different norm on each rank)"
            )
        return tuple(notes)

    @property
    def world_size(self) -> int:
        return self.plan.sharding.world_size

    @property
    def strategy(self) -> Strategy:
        return self.plan.sharding.strategy

    @property
    def floor_bytes_per_rank(self) -> float:
        """What no ZeRO scheme goes below: every parameter gathered once and reduce-scattered once (in the dtypes
        mixed precision gathers and reduces in)."""
        return floor_bytes(self._gathered_bytes, self.world_size, 1, self.reduced_param_bytes)

    @property
    def textbook_bytes_per_rank(self) -> float:
        """The textbook cost of the strategy: ZeRO-2 gathers every parameter once, ZeRO-3 twice."""
        gathers = 2 if self.strategy is Strategy.ZERO3 else 1
        return floor_bytes(self._gathered_bytes, self.world_size, gathers, self.reduced_param_bytes)

    @property
    def _gathered_bytes(self) -> int:
        return self.param_bytes if self.gathered_param_bytes is None else self.gathered_param_bytes

    @property
    def bytes_per_rank(self) -> float | None:
        return None if self.stats is None else self.stats.bytes_per_rank

    def __str__(self) -> str:
        notes = ["", "Notes:", *(f"  {n}" for n in self.notes)] if self.notes else []
        return "\n".join([*self._unit_table(), "", *self._totals(), *self._auto_lines(), *notes])

    def _auto_lines(self) -> list[str]:
        """Under ``FSDP("auto")``: the plan with its reasons, and the traced peak held against the budget."""
        auto = self.plan.auto
        if auto is None:  # units= left out: the step model's choice of units, and why
            choice = self.plan.units_choice
            return [] if choice is None else ["", str(choice)]
        lines = ["", str(auto)]
        traced = self.memory.peak
        if traced is not None:
            verdict = "" if auto.budget is None else (
                f": within the {human_bytes(auto.budget)} budget" if traced <= auto.budget
                else f": OVER the {human_bytes(auto.budget)} budget by {human_bytes(traced - auto.budget)} (the planner's "
                "estimate was too low: plan with a smaller budget)")
            lines.append(f"the traced step peaks at {human_bytes(traced)} (the planner predicted "
                         f"{human_bytes(auto.prediction.peak_bytes)}){verdict}")
        return lines

    def _unit_table(self) -> list[str]:
        sp = self.plan.sharding
        head = (
            f"FSDP explain: strategy={sp.strategy.value} world_size={sp.world_size} "
            + (f"(per shard group) replicas={self._replicas()} " if self._replicas() else "")
            + f"units={len(self.units)} policy={self.plan.policy}"
        )
        cols = ("unit", "params", "numel", "shard/rank", "unsharded", "pad", "reshard", "ckpt")
        if self.stats is not None:
            cols += ("fwd gather issue..wait", "bwd gather", "reduce-scatter")
        rows = []
        for u in self.units:
            row = (
                u.name,
                str(len(u.params)),
                f"{u.numel:,}",
                human_bytes(u.shard_bytes),
                human_bytes(u.unsharded_bytes),
                f"{u.padding:,}",
                "yes" if u.reshard_after_forward else "no",
                "yes" if u.checkpointed else "no",
            )
            if self.stats is not None:
                row += tuple(_collective_cell(c) for c in (u.forward_gathers, u.backward_gathers, u.reduce_scatters))
            rows.append(row)
        legend = (["(issue..wait: op positions in the final trace, then the estimated FLOPs computed in between)"]
                  if self.stats is not None else [])
        # the plan's notes: ZeRO-3's last unit kept gathered into the backward or resharded, and why; units split
        # by dtype; parameters the forward never reads
        plan_notes = [f"note: {n}" for n in self.plan.notes]
        # what the plan's decisions were made from: the step every rank agreed on at the first compile
        if self.plan.planned_from is not None:
            plan_notes.append(f"note: {self.plan.planned_from}")
        return [head, *(f"  {o}" for o in self.options), *format_table(cols, rows), *legend, *plan_notes]

    def _totals(self) -> list[str]:
        m = self.memory
        if m.step is None:
            head = "Predicted memory per rank:"
        elif m.offloaded_to:
            head = "Predicted memory per rank (peak on the device = step peak; figures rounded):"
        else:
            head = "Predicted memory per rank (peak = sharded parameters + optimizer state + step peak; figures rounded):"
        return [*self._bytes_lines(), head, *self._state_lines(), *self._step_lines(), *self._gathered_lines()]

    def _bytes_lines(self) -> list[str]:
        n, replicas = self.world_size, self._replicas()
        ranks = f"world size {n}" if not replicas else f"HSDP: {replicas} replicas x a shard group of {n} ranks"
        lines = [f"Per rank and step ({ranks}, ring model: a collective of S bytes over N ranks sends (N-1)/N*S):"]
        floor = self.floor_bytes_per_rank
        if self.stats is not None:
            sent = self.stats.bytes_per_rank
            lines.append(
                f"  communicated  {human_bytes(int(sent)):>10}  in {self.stats.breakdown()}"
                + (f"  ({sent / floor:.2f}x the floor)" if floor else "")
            )
            lines.extend(self._link_lines())
            if n == 1 and not self.stats.count(ALL_GATHER):
                lines.append(f"  gathered      {human_bytes(0):>10}  (one rank: each unit's parameters are views of its "
                             "shards, fsdp_view_shards in the traces; no all-gather is issued)")
        lines.append(
            f"  floor         {human_bytes(int(floor)):>10}  (each of the {human_bytes(self.param_bytes)} "
            "of parameters gathered once and reduce-scattered once"
            + self._sent_dtypes_note() + ")"
        )
        if self.strategy is Strategy.ZERO3:
            lines.append(
                f"  ZeRO-3 book   {human_bytes(int(self.textbook_bytes_per_rank)):>10}  (every unit gathered again "
                f"in the backward; {self._not_regathered()})"
            )
        return lines

    def _not_regathered(self) -> str:
        """Which units this plan does not gather again in the backward, as its resharding decided."""
        kept = [u.name for u in self.plan.units if not u.reshard_after_forward]
        if len(self.plan.units) and kept == [self.plan.units[-1].name]:
            return "this pass does not re-gather the last unit, nor a unit the backward never reads"
        if not kept:
            return "this pass re-gathers the last unit too (see its note), not a unit the backward never reads"
        return (f"this pass does not re-gather the {len(kept)} unit(s) kept after forward, nor a unit the backward "
                "never reads")

    def _sent_dtypes_note(self) -> str:
        """Under mixed precision, the bytes the floor counts: the parameters as gathered and as reduced (an 8-bit
        gather's codes and scales, beside what they are held as once dequantized, which the floor does not count)."""
        gathered, reduced = self._gathered_bytes, self.reduced_param_bytes
        if gathered == self.param_bytes and reduced in (None, self.param_bytes):
            return ""
        held = ""
        if self.gather_dtype is not None and self.held_param_bytes is not None:
            held = (f" ({str(self.gather_dtype).removeprefix('torch.')} codes and scales; held dequantized: "
                    f"{human_bytes(self.held_param_bytes)})")
        return f"; {human_bytes(gathered)} as gathered{held}, {human_bytes(reduced)} as reduced"

    def _replicas(self) -> int:
        """HSDP: the ranks of the replicate group the gradient shards are all-reduced over (0: not HSDP)."""
        if self.stats is None:
            return 0
        return max((c.group_size for c in self.stats.collectives if c.kind is ALL_REDUCE), default=0)

    def _link_lines(self) -> list[str]:
        """HSDP: the bytes over each group, i.e. each kind of link when every shard group is one node."""
        replicas = self._replicas()
        if not replicas:
            return []
        across = self.stats.replicate_bytes_per_rank
        within = self.stats.bytes_per_rank - across
        return [
            f"    of which {human_bytes(int(within)):>10}  over the shard group ({self.world_size} ranks: gathers and "
            "reduce-scatters; within a node when a node is a shard group)",
            f"    and      {human_bytes(int(across)):>10}  over the replicate group ({replicas} ranks: the "
            "all-reduce of each gradient shard; across nodes, 2(R-1)/R of the shards)",
        ]

    def _state_lines(self) -> list[str]:
        """What lives between steps: shards and optimizer state."""
        m = self.memory
        where = f"  (on {m.offloaded_to})" if m.offloaded_to else ""
        return [
            f"  sharded parameters      {human_bytes(m.sharded_params):>10}{where}",
            f"  optimizer state         {human_bytes(m.optimizer_state):>10}  "
            f"({m.optimizer_states_per_element} state(s) per trainable element, e.g. Adam 2, SGD+momentum 1)"
            + (f", on {m.offloaded_to}" if m.offloaded_to else ""),
        ]

    def _accumulator_note(self) -> str:
        m = self.memory
        return (
            f"no_sync accumulators {human_bytes(m.accumulator_bytes)} per rank, not in the peak above: inside "
            "no_sync() each backward adds every unit's unsharded gradient to them (vs "
            f"{human_bytes(m.gradient_shards)} of gradient shards) and issues no reduce-scatter; the first "
            "backward after the block reduce-scatters their sum"
        )

    def _step_lines(self) -> list[str]:
        """The step's peak, where it is, by kind (the kinds add up to it), and the total."""
        m = self.memory
        if m.step is None:
            return ["  step peak               (needs the traces: explain a jitted model after one step)"]
        s = m.step
        kinds = s.peak_by_kind
        at = s.peak_trace.peak_at
        lines = [
            (
                f"  step peak               {human_bytes(s.peak_bytes):>10}  (in the {s.peak_phase}, at op {at}: "
                f"{s.peak_trace.op_at(at)}), of which"
            ),
            *(
                f"    {title:<22}{human_bytes(kinds.get(kind, 0)):>10}" + (f"  ({what})" if what else "")
                for kind, title, what in _KIND_LINES
            ),
            f"  peak                    {human_bytes(m.peak):>10}" + ("  on the device" if m.offloaded_to else ""),
        ]
        if m.offloaded_to:
            lines.append(
                f"  on {m.offloaded_to:<20} {human_bytes(m.host):>10}  (shards, gradient shards, optimizer state)"
            )
        lines.append(
            f"  (the forward saves {human_bytes(s.saved_bytes)} for the backward, of which "
            f"{human_bytes(s.saved_gathered_bytes)} gathered parameters; all {human_bytes(m.gradient_shards)} of "
            "gradient shards exist at the end of the backward and stay until zero_grad)"
        )
        return lines

    def _gathered_lines(self) -> list[str]:
        """The most gathered parameter bytes live at once, where, and what they are: whole gathered buffers and
        the parameters cut out of them, against all parameters unsharded."""
        g = self.memory.gathered
        if g is None or not g.buffers:
            return []
        flat, dequantized, cut = g.flat_buffers, g.dequantized, g.cut_out
        flat_units = _bytes_by_unit(flat, lambda b: b.unit)
        cut_units = _bytes_by_unit(cut, lambda b: b.unit)
        parts = []
        padded = any(u.padding for u in self.units)
        codes = "" if self.gather_dtype is None else f" of {str(self.gather_dtype).removeprefix('torch.')} codes"
        if flat:
            parts.append(
                f"{human_bytes(sum(b.nbytes for b in flat))} of gathered buffers{codes} ({_units(flat_units)}, whole"
                + (", padding rows included)" if padded else ")")
            )
        if dequantized:
            by_unit = _bytes_by_unit(dequantized, lambda b: b.unit)
            nbytes = human_bytes(sum(b.nbytes for b in dequantized))
            parts.append(f"{nbytes} of dequantized buffers ({_units(by_unit)})")
        if cut:
            parts.append(f"{human_bytes(sum(b.nbytes for b in cut))} of parameters cut out of them ({_units(cut_units)})")
        lines = [
            f"Gathered parameters at most {human_bytes(g.bytes)} at once (in the {g.phase}, at op {g.at}: {g.op}):",
            f"  {' + '.join(parts)}; all parameters unsharded: {human_bytes(self.param_bytes)}",
        ]
        if g.bytes > self.param_bytes:
            lines.append(
                "  (more than the model: a unit's parameters are copied out of its gathered buffer, and during the "
                "copy both are live"
                + (", while other units' gathers are in flight" if len(flat_units) > 1 else "")
                + (", padding rows included" if padded else "")
                + ")"
            )
        return lines


# the kinds of memory the step's peak is split into, in the order explain() lists them: (kind, title, what)
_KIND_LINES = (
    (GATHERED, "gathered parameters", "all-gather buffers, the parameters cut out of them"),
    (SAVED, "saved activations", "forward results kept for the backward"),
    (GRADIENTS, "unsharded gradients", "parameter gradients, the flat buffers packed for their reduce-scatters"),
    (GRAD_SHARDS, "gradient shards", "this rank's reduced gradients, for the optimizer"),
    (OTHER, "other tensors", "activations and their gradients, temporaries, packed shards"),
)


def _bytes_by_unit(buffers, unit_of) -> list[tuple[str, int]]:
    """(unit, bytes) of ``buffers``, the most bytes first, ties by name (the buffers come in no fixed order)."""
    by_unit: dict[str, int] = {}
    for b in buffers:
        by_unit[unit_of(b)] = by_unit.get(unit_of(b), 0) + b.nbytes
    return sorted(by_unit.items(), key=lambda item: (-item[1], item[0]))


def _units(by_unit: list[tuple[str, int]], shown: int = 3) -> str:
    """``unit 'a'``, or ``3 units: 'a' 2.0 MiB, 'b' 1.0 MiB, 'c' 1.0 KiB``, naming the ``shown`` largest."""
    if len(by_unit) == 1:
        return f"unit {by_unit[0][0]!r}"
    named = ", ".join(f"{name!r} {human_bytes(n)}" for name, n in by_unit[:shown])
    rest = by_unit[shown:]
    more = f", {len(rest)} more {human_bytes(sum(n for _, n in rest))}" if rest else ""
    return f"{len(by_unit)} units: {named}{more}"


def _collective_cell(collectives: tuple[CollectiveOverlap, ...]) -> str:
    if not collectives:
        return "-"
    cells = []
    for c in collectives:
        overlap = "EXPOSED" if c.exposed else _flops(c.flops_between)
        cells.append(f"{c.issued_at}..{c.waited_at} {overlap}")
    return "; ".join(cells)


def _flops(n: float) -> str:
    for unit, scale in (("TF", 1e12), ("GF", 1e9), ("MF", 1e6), ("kF", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} F"


def _optimizer_states(optimizer) -> int:
    if isinstance(optimizer, int) and optimizer >= 0:
        return optimizer
    if isinstance(optimizer, str) and optimizer.lower() in OPTIMIZER_STATES:
        return OPTIMIZER_STATES[optimizer.lower()]
    fail(
        f"Unknown optimizer {optimizer!r} for the memory prediction.",
        f"Pass one of {sorted(OPTIMIZER_STATES)}, or the number of parameter-sized states it keeps per element.",
    )


def _unit_rows(plan: UnitPlan, overlaps) -> tuple[UnitRow, ...]:
    """One row per unit: its sizes, and its collectives in the final traces (``overlaps``)."""
    rows = []
    for u in plan.units:
        numel, shard_numel, pad = plan.unit_numel(u)
        shard_bytes = shard_numel * plan.unit_itemsize(u)
        mine = [c for c in overlaps if c.unit == u.name]
        rows.append(
            UnitRow(
                u.name,
                u.params,
                numel,
                shard_bytes,
                shard_bytes * plan.sharding.world_size,
                pad,
                u.reshard_after_forward,
                u.checkpointed,
                tuple(c for c in mine if c.phase == "forward" and c.kind is ALL_GATHER),
                tuple(c for c in mine if c.phase == "backward" and c.kind is ALL_GATHER),
                tuple(c for c in mine if c.kind is REDUCE_SCATTER),
            )
        )
    return tuple(rows)


def _accumulator_bytes(plan: UnitPlan, precision: MixedPrecision) -> int:
    """no_sync's unsharded gradients: per unit, as the backward packs them (a tied parameter in each unit
    that reads it), in the reduce dtype."""
    sharding = plan.sharding
    reduce = precision.reduce_dtype or precision.param_dtype
    return sum(
        spec.layout.shard_numel * sharding.world_size * (spec.itemsize if reduce is None else reduce.itemsize)
        for u in plan.units
        for spec in map(sharding.param, u.params)
        if spec.requires_grad
    )


def _memory(plan: UnitPlan, step: CompiledStep | None, optimizer, precision, offload_to) -> MemoryPrediction:
    owners = plan.sharding.owners()
    trainable_shard_bytes = sum(p.layout.shard_numel * p.itemsize for p in owners if p.requires_grad)
    states = _optimizer_states(optimizer)
    memory = None if step is None else step_memory(step.forward, step.backward)
    return MemoryPrediction(
        sharded_params=sum(p.layout.shard_numel * p.itemsize for p in owners),
        optimizer_state=states * trainable_shard_bytes,
        optimizer_states_per_element=states,
        gradient_shards=trainable_shard_bytes,
        step=memory,
        offloaded_to=offload_to,
        accumulator_bytes=_accumulator_bytes(plan, precision),
        gathered=None if memory is None else memory.gathered_peak(),
        unit_of_collective={} if step is None else dict(step.unit_of_collective),
    )


def _options(plan: UnitPlan, precision: MixedPrecision, offload_to) -> tuple[str, ...]:
    """One line per option the user set."""
    options = [f"mixed precision: {precision.describe()}"] if precision != FULL_PRECISION else []
    if offload_to is not None:
        options.append(
            f"offload: shards, gradient shards and optimizer state live on {offload_to}; each unit is copied to the "
            "device before its gather, each gradient shard back after its reduce-scatter"
        )
    if plan.checkpointed:
        options.append(
            f"activation checkpointing: {len(plan.checkpointed)} unit(s), recomputed from the backward's gather"
        )
    return tuple(options)


def _explanation(plan: UnitPlan, step: CompiledStep | None, optimizer, precision, offload_to) -> Explanation:
    memory = _memory(plan, step, optimizer, precision, offload_to)
    owners = plan.sharding.owners()
    reduce_dtype = precision.reduce_dtype or precision.param_dtype

    def nbytes(dtype, specs) -> int:
        return sum(p.nbytes(dtype if p.dtype.is_floating_point else None) for p in specs)

    return Explanation(
        plan,
        _unit_rows(plan, step_overlap(step).rows if step is not None else ()),
        memory,
        step_stats(step.forward, step.backward, plan.sharding.world_size) if step is not None else None,
        sum(p.nbytes() for p in owners),
        _options(plan, precision, offload_to),
        step is not None and _made_under_no_sync(step),
        sum(map(precision.sent_nbytes, owners)),  # quantized (gather_dtype): codes and scales
        nbytes(reduce_dtype, [p for p in owners if p.requires_grad]),
        precision.gather_dtype,
        sum(map(precision.held_nbytes, owners)),
    )


def _made_under_no_sync(step: CompiledStep) -> bool:
    """Whether the step's backward accumulates gradients (inside no_sync) or adds them (right after it)."""
    return step.backward is not None and any(map(is_grad_accumulation, step.backward.bound_symbols))


def explain_step(step: CompiledStep, optimizer="adam") -> Explanation:
    """The explanation of one compiled step: its plan, and its final forward / backward traces.

    ``optimizer``: for the optimizer-state estimate, ``"adam"`` (2 parameter-sized states per trainable
    element), ``"sgd_momentum"`` (1), ``"sgd"`` (0), or a number of states.
    """
    options = step.options
    return _explanation(step.plan, step, optimizer, options.mixed_precision, options.offload_to)


def explain_traces(plan: UnitPlan, forward, backward=None, optimizer="adam", mixed_precision=None) -> Explanation:
    """The explanation of traces the functional path made (:mod:`fsdp_pass.functional`: ``plan`` from
    ``shard_functional_trace``, ``forward`` and ``backward`` from ``derive_backward_and_lower``), the same as
    :func:`explain_step` gives for the compile ``thunder.jit`` with ``FSDP`` makes of the same trace. One functional
    trace can be sharded at many world sizes, where each dry run would trace the model again."""
    found = {}
    for trace in (forward, backward):
        if trace is not None:
            found.update((name, unit.name) for name, (unit, _) in units_of_collectives(trace, plan).items())
    step = CompiledStep(plan, FSDPOptions(strategy=plan.sharding.strategy), forward, backward, found)
    return _explanation(plan, step, optimizer, mixed_precision or FULL_PRECISION, None)


def explain_plan(plan: UnitPlan, optimizer="adam") -> Explanation:
    """The explanation of a plan alone: sizes and floors (the schedule and the step's memory need traces)."""
    return _explanation(plan, None, optimizer, FULL_PRECISION, None)
