"""What FSDP does to a model, unit by unit, and what it costs each rank per step.

``explain_step(compiled_step) -> Explanation`` (what ``fsdp_pass.explain(jitted_model)`` returns after one
training step, or a dry run) prints

1. per unit: its parameters, numel, sharded and unsharded bytes, padding, whether it is resharded
   after forward, and for each of its collectives (forward all-gather, backward all-gather,
   reduce-scatter) where it is issued and waited in the final trace (op positions) and the compute
   that runs in between (estimated MFLOP; ``EXPOSED`` when none);
2. per rank and step: bytes sent against the floor no ZeRO scheme can go below;
3. per rank: predicted peak memory = sharded parameters + optimizer state + the step's peak (from the
   traces, :mod:`fsdp_pass.report.memory`), with the peak split into gathered parameters, tensors saved for
   the backward and everything else (activations, gradients, temporaries). With ``offload_to`` the
   shards, their gradients and the optimizer state are counted on the host, not the device;
4. under the header, the options the user set: mixed precision, offload, checkpointed units (nothing when
   none is);
5. notes, only where they apply: what :func:`fsdp_pass.no_sync`'s accumulators hold, when the compile was
   made under ``no_sync`` (its backward accumulates or flushes) or when asked for with
   :meth:`Explanation.with_no_sync`; how to clip gradients, when there is more than one rank.

``explain_plan(plan)`` on a :class:`~fsdp_pass.plan.units.UnitPlan` alone gives the sizes and the floors:
the schedule and the step's memory need the traces.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fsdp_pass.compiled_step import CompiledStep
from fsdp_pass.errors import fail
from fsdp_pass.op_names import ALL_GATHER, REDUCE_SCATTER
from fsdp_pass.plan.mixed_precision import FULL_PRECISION, MixedPrecision
from fsdp_pass.plan.sharding import Strategy
from fsdp_pass.plan.units import UnitPlan
from fsdp_pass.predicates import is_grad_accumulation
from fsdp_pass.report.memory import GATHERED, OTHER, SAVED, StepMemory, step_memory
from fsdp_pass.report.overlap import CollectiveOverlap, step_overlap
from fsdp_pass.report.step_stats import StepStats, floor_bytes, step_stats
from fsdp_pass.text import format_table, human_bytes

OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1, "none": 0}


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

    def with_no_sync(self) -> Explanation:
        """This explanation with a note of what :func:`fsdp_pass.no_sync`'s accumulators would hold per rank
        (shown without asking only when the compile was made under ``no_sync``)."""
        return replace(self, no_sync=True)

    @property
    def notes(self) -> tuple[str, ...]:
        """One line per note that applies: no_sync's accumulators (see :attr:`no_sync`), clipping (world > 1)."""
        notes = [self._accumulator_note()] if self.no_sync else []
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
        """What no ZeRO scheme goes below: every parameter gathered once and reduce-scattered once."""
        return floor_bytes(self.param_bytes, self.world_size, 1)

    @property
    def textbook_bytes_per_rank(self) -> float:
        """The textbook cost of the strategy: ZeRO-2 gathers every parameter once, ZeRO-3 twice."""
        return floor_bytes(self.param_bytes, self.world_size, 2 if self.strategy is Strategy.ZERO3 else 1)

    @property
    def bytes_per_rank(self) -> float | None:
        return None if self.stats is None else self.stats.bytes_per_rank

    def __str__(self) -> str:
        notes = ["", "Notes:", *(f"  {n}" for n in self.notes)] if self.notes else []
        return "\n".join([*self._unit_table(), "", *self._totals(), *notes])

    def _unit_table(self) -> list[str]:
        sp = self.plan.sharding
        head = (
            f"FSDP explain: strategy={sp.strategy.value} world_size={sp.world_size} "
            f"units={len(self.units)} policy={self.plan.policy}"
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
        return [head, *(f"  {o}" for o in self.options), *format_table(cols, rows)] + (
            ["(issue..wait: op positions in the final trace, then the estimated FLOPs computed in between)"]
            if self.stats is not None
            else []
        )

    def _totals(self) -> list[str]:
        return [*self._bytes_lines(), "Predicted memory per rank:", *self._state_lines(), *self._step_lines()]

    def _bytes_lines(self) -> list[str]:
        n = self.world_size
        lines = [f"Per rank and step (world size {n}, ring model: a collective of S bytes sends (N-1)/N*S):"]
        floor = self.floor_bytes_per_rank
        if self.stats is not None:
            sent = self.stats.bytes_per_rank
            lines.append(
                f"  communicated  {human_bytes(int(sent)):>10}  in {self.stats.breakdown()}"
                + (f"  ({sent / floor:.2f}x the floor)" if floor else "")
            )
        lines.append(
            f"  floor         {human_bytes(int(floor)):>10}  (each of the {human_bytes(self.param_bytes)} "
            "of parameters gathered once and reduce-scattered once)"
        )
        if self.strategy is Strategy.ZERO3:
            lines.append(
                f"  ZeRO-3 book   {human_bytes(int(self.textbook_bytes_per_rank)):>10}  (gathered again in "
                "the backward; this pass skips units the backward does not read, and the last unit)"
            )
        return lines

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
        """The step's peak, by kind, and the total."""
        m = self.memory
        if m.step is None:
            return ["  step peak               (needs the traces: explain a jitted model after one step)"]
        s = m.step
        kinds = s.peak_by_kind
        lines = [
            f"  step peak               {human_bytes(s.peak_bytes):>10}  (in the {s.peak_phase})",
            f"    gathered parameters   {human_bytes(kinds.get(GATHERED, 0)):>10}",
            f"    saved activations     {human_bytes(kinds.get(SAVED, 0)):>10}",
            f"    other tensors         {human_bytes(kinds.get(OTHER, 0)):>10}  (activations, gradients, temporaries)",
            f"  peak                    {human_bytes(m.peak):>10}" + ("  on the device" if m.offloaded_to else ""),
        ]
        if m.offloaded_to:
            lines.append(
                f"  on {m.offloaded_to:<20} {human_bytes(m.host):>10}  (shards, gradient shards, optimizer state)"
            )
        lines.append(
            f"  (the forward saves {human_bytes(s.saved_bytes)} for the backward, of which "
            f"{human_bytes(s.saved_gathered_bytes)} gathered parameters; peak unsharded parameters at any "
            f"moment {human_bytes(self.stats.peak_gathered_bytes)}; gradient shards "
            f"{human_bytes(m.gradient_shards)} stay until zero_grad)"
        )
        return lines


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
    return MemoryPrediction(
        sharded_params=sum(p.layout.shard_numel * p.itemsize for p in owners),
        optimizer_state=states * trainable_shard_bytes,
        optimizer_states_per_element=states,
        gradient_shards=trainable_shard_bytes,
        step=None if step is None else step_memory(step.forward, step.backward),
        offloaded_to=offload_to,
        accumulator_bytes=_accumulator_bytes(plan, precision),
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
    return Explanation(
        plan,
        _unit_rows(plan, step_overlap(step).rows if step is not None else ()),
        memory,
        step_stats(step.forward, step.backward, plan.sharding.world_size) if step is not None else None,
        sum(p.layout.numel * p.itemsize for p in owners),
        _options(plan, precision, offload_to),
        step is not None and _made_under_no_sync(step),
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


def explain_plan(plan: UnitPlan, optimizer="adam") -> Explanation:
    """The explanation of a plan alone: sizes and floors (the schedule and the step's memory need traces)."""
    return _explanation(plan, None, optimizer, FULL_PRECISION, None)
