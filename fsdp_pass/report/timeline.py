"""Record one training step's collectives on real gloo ranks, and draw the step as a timeline.

    timelines = record_timelines({"prefetch=1": Schedule(prefetch=1), "Thunder's order": None})
    draw_timelines(timelines.values())          # a matplotlib Figure: compute lane over communication lane
    print(compare_timelines(timelines.values()))

1. :func:`record_timelines` spawns ``world_size`` CPU processes joined by a gloo group; each runs
   :func:`step_timelines` (which also runs on any rank whose default group is initialized). For each
   schedule, the main job's small Llama-style model (:class:`fsdp_pass.models.tiny_lm.TinyLM`) is jitted with
   ``FSDP(strategy, schedule=...)`` and trained a few warm-up steps; then a few forward + backward steps
   are recorded with ``WAIT_CLOCK.reset(record=True)`` and the fastest is kept (the least disturbed):
   every collective's issue, completion, wait start and wait end, as seconds since the step started.
2. The recorded collectives are matched, in issue order, to the collectives of the final traces (the
   forward's, then the backward's): that names each one's phase and unit.
3. :func:`draw_timelines`: per step, the host thread (running, or blocked in a wait) above the
   collectives in flight (issue to completion, one colour per kind, labelled with the unit, a thin line
   while the result waits to be picked up); a dashed line where the backward starts. gloo reports no
   completion for a reduce-scatter (its work has no future): those are drawn pale, up to their wait's end.

The host thread runs the traces one op at a time, so whenever it is not blocked in a wait it is computing
(or running Python). gloo runs the collectives on its own threads, which on a machine with few cores also
compete with the compute for CPU time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import thunder
import torch
import torch.distributed as dist
from fsdp_pass_executors import WAIT_CLOCK, executors_for

from fsdp_pass.compiled_step import PHASES, CompiledStep
from fsdp_pass.errors import check
from fsdp_pass.models.tiny_lm import TinyLM, counting_batch
from fsdp_pass.models.zoo import lm_loss
from fsdp_pass.op_names import ALL_GATHER, REDUCE_SCATTER, CollectiveKind
from fsdp_pass.plan.schedule import Schedule
from fsdp_pass.predicates import collective_kind, collectives
from fsdp_pass.report.overlap import OverlapReport, step_overlap
from fsdp_pass.text import format_table
from fsdp_pass.ranks import run_on_local_ranks
from fsdp_pass.transform import FSDP

try:  # drawing needs matplotlib (the notebooks extra); recording does not
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
except ImportError:
    Figure = Line2D = Patch = None

KIND_COLORS = {ALL_GATHER: "tab:blue", REDUCE_SCATTER: "tab:orange"}
_SEQ, _VOCAB = 32, 64  # TinyLM's defaults: block size and vocabulary


@dataclass(frozen=True)
class TimedCollective:
    """One collective of the recorded step; times in seconds since the step started."""

    phase: str  # "forward" or "backward"
    kind: CollectiveKind
    unit: str
    numel: int  # of the full (unsharded) buffer
    issued: float
    completed: float  # NaN where the backend did not say
    wait_started: float
    wait_ended: float

    @property
    def blocked(self) -> float:
        """Seconds the host thread spent blocked in this collective's wait."""
        return self.wait_ended - self.wait_started


@dataclass(frozen=True)
class StepTimeline:
    """One recorded forward + backward on one rank; times in seconds since the step started."""

    label: str
    rank: int
    world_size: int
    strategy: str
    backward_start: float  # the forward (and the loss) ends here
    end: float
    collectives: tuple[TimedCollective, ...]  # in issue order
    overlap: OverlapReport  # the static report of the same traces (what compute lies between issue and wait)

    def blocked(self, phase: str | None = None) -> float:
        """Seconds the host thread was blocked in waits (in ``phase``, or the whole step)."""
        return sum(c.blocked for c in self.collectives if phase in (None, c.phase))


# ------------------------------------------------------------------------------------------ recording
def name_events(events, step: CompiledStep, start: float) -> tuple[TimedCollective, ...]:
    """Match ``WAIT_CLOCK.events`` of one step to the final traces' collectives, in issue order."""
    traced = [(phase, b) for phase in PHASES for b in collectives(step.final_trace(phase))]
    ran = sorted(events, key=lambda e: e.issued)
    if [e.kind for e in ran] != [collective_kind(b) for _, b in traced]:
        raise RuntimeError(
            f"the step issued {[str(e.kind) for e in ran]}, but its traces hold "
            f"{[str(collective_kind(b)) for _, b in traced]}: "
            "was anything else waited on through fsdp_comm while recording?"
        )
    return tuple(
        TimedCollective(
            phase,
            e.kind,
            step.unit_of_collective.get(b.output.name, "?"),
            e.numel,
            e.issued - start,
            e.completed - start,
            e.wait_started - start,
            e.wait_ended - start,
        )
        for (phase, b), e in zip(traced, ran)
    )


def _rank_batch(step: int, batch_per_rank: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = counting_batch(batch_per_rank * world, _SEQ, _VOCAB, step)
    mine = slice(rank * batch_per_rank, (rank + 1) * batch_per_rank)
    return x[mine], y[mine]


def _loss(jm, x, y):
    return lm_loss(jm(x), y)


@dataclass(frozen=True)
class _Recorded:
    events: list  # WAIT_CLOCK.events of the step
    start: float
    backward_start: float
    end: float


def _recorded_step(jm, x, y) -> _Recorded:
    """One forward + backward with the wait clock recording."""
    dist.barrier()  # the ranks start the step together
    WAIT_CLOCK.reset(record=True)
    try:
        start = time.perf_counter()
        loss = _loss(jm, x, y)
        backward_start = time.perf_counter()
        loss.backward()
        return _Recorded(WAIT_CLOCK.events, start, backward_start, time.perf_counter())
    finally:
        WAIT_CLOCK.reset()


def _train_step(jm, opt, x, y) -> None:
    _loss(jm, x, y).backward()
    opt.step()
    opt.zero_grad()


def _compiled(schedule, strategy, layers, width, units):
    """(FSDP transform, jitted TinyLM, optimizer), the same initial weights for every schedule."""
    torch.manual_seed(0)
    fsdp = FSDP(strategy, units=units, schedule=schedule)
    model = TinyLM(d=width, n_layer=layers, hidden=2 * width)
    jm = thunder.jit(model, transforms=[fsdp], executors=executors_for("cpu"))
    return fsdp, jm, torch.optim.SGD(jm.parameters(), lr=1e-2)


def _timeline(label: str, fsdp: FSDP, recorded: _Recorded) -> StepTimeline:
    return StepTimeline(
        label,
        dist.get_rank(),
        dist.get_world_size(),
        fsdp.strategy.value,
        recorded.backward_start - recorded.start,
        recorded.end - recorded.start,
        name_events(recorded.events, fsdp.compiled_step, recorded.start),
        step_overlap(fsdp.compiled_step),
    )


def step_timelines(
    schedules: dict[str, Schedule | None],
    strategy: str = "zero3",
    layers: int = 2,
    width: int = 256,
    batch_per_rank: int = 1,
    warmup_steps: int = 2,
    recorded_steps: int = 7,
    units="blocks",
) -> dict[str, StepTimeline]:
    """On this rank (every rank of the default group calls it): label -> the recorded step of each schedule.

    Each schedule trains its own copy of ``TinyLM(d=width, hidden=2 * width, n_layer=layers)`` for
    ``warmup_steps`` (the first compiles), then ``recorded_steps`` are recorded, the schedules taking turns
    so that a disturbance hits them alike; the fastest of each is kept: noise (other processes, the OS)
    only adds time. The defaults (wide layers, one sequence per rank) make a gather take about as long as
    the compute of a layer on a CPU, so the schedule matters. ``units``: ``FSDP(units=...)`` of every copy (by
    default one unit per block, so the units are the same whatever plan ``FSDP`` makes without ``units=``).
    """
    runs = {label: _compiled(schedule, strategy, layers, width, units) for label, schedule in schedules.items()}
    for step in range(warmup_steps):
        for _, jm, opt in runs.values():
            _train_step(jm, opt, *_rank_batch(step, batch_per_rank))
    recorded: dict[str, list[_Recorded]] = {label: [] for label in runs}
    for step in range(warmup_steps, warmup_steps + recorded_steps):
        for label, (_, jm, opt) in runs.items():
            recorded[label].append(_recorded_step(jm, *_rank_batch(step, batch_per_rank)))
            opt.step()
            opt.zero_grad()
    return {
        label: _timeline(label, fsdp, min(recorded[label], key=lambda r: r.end - r.start))
        for label, (fsdp, _, _) in runs.items()
    }


def record_timelines(
    schedules: dict[str, Schedule | None], world_size: int = 2, timeout_s: int = 120, **kwargs
) -> dict[str, StepTimeline]:
    """Spawn ``world_size`` gloo ranks on this machine, run :func:`step_timelines` on them (``kwargs``
    go there) and return rank 0's timelines. A rank that fails raises here, with its traceback."""
    return run_on_local_ranks(step_timelines, world_size, schedules, timeout_s=timeout_s, **kwargs)[0]


# ------------------------------------------------------------------------------------------- tables
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def compare_timelines(timelines: Iterable[StepTimeline]) -> str:
    """One row per recorded step: its length, the forward and backward, and the time blocked in waits."""
    rows = [
        (
            t.label,
            _ms(t.end),
            _ms(t.backward_start),
            _ms(t.end - t.backward_start),
            _ms(t.blocked()),
            f"{_ms(t.blocked('forward'))} / {_ms(t.blocked('backward'))}",
            f"{100 * t.blocked() / t.end:.0f}%",
            f"{len(t.overlap.exposed())} of {len(t.collectives)}",
        )
        for t in timelines
    ]
    header = ("schedule", "step", "forward", "backward", "blocked", "fwd / bwd", "of step", "exposed (static)")
    return "\n".join(format_table(header, rows))


def blocked_by_collective(timelines: Iterable[StepTimeline]) -> str:
    """Time blocked in each collective's wait, one column per recorded step (rows in issue order)."""
    timelines = list(timelines)
    by_key = [{(c.phase, c.kind, c.unit): c for c in t.collectives} for t in timelines]
    keys = dict.fromkeys(key for seen in by_key for key in seen)
    rows = [(*key, *(_ms(seen[key].blocked) if key in seen else "-" for seen in by_key)) for key in keys]
    return "\n".join(format_table(("phase", "collective", "unit", *(t.label for t in timelines)), rows))


# ------------------------------------------------------------------------------------------ drawing
def _blocked_segments(t: StepTimeline) -> list[tuple[float, float]]:
    return sorted((c.wait_started, c.wait_ended) for c in t.collectives)


def running_segments(t: StepTimeline) -> list[tuple[float, float]]:
    """(start, end) of the host thread's time not blocked in a wait, in seconds."""
    segments, now = [], 0.0
    for start, end in _blocked_segments(t):
        if start > now:
            segments.append((now, start))
        now = max(now, end)
    if t.end > now:
        segments.append((now, t.end))
    return segments


def _in_flight_end(c: TimedCollective) -> float:
    return c.completed if math.isfinite(c.completed) else c.wait_ended


def communication_rows(t: StepTimeline, label_width: float) -> list[int]:
    """A row per collective such that no two in one row overlap (label of ``label_width`` s/char included)."""
    row_ends: list[float] = []
    rows = []
    for c in t.collectives:
        reach = max(c.wait_ended, c.issued + len(c.unit) * label_width)
        row = next((i for i, end in enumerate(row_ends) if end <= c.issued), len(row_ends))
        if row == len(row_ends):
            row_ends.append(reach)
        row_ends[row] = reach
        rows.append(row)
    return rows


def _draw_collective(ax, c: TimedCollective, y: float) -> None:
    ms, color = 1e3, KIND_COLORS.get(c.kind, "tab:gray")
    ax.broken_barh(
        [(c.wait_started * ms, c.blocked * ms)], (-0.3, 0.6), facecolor="white", edgecolor=color, hatch="////"
    )
    done = _in_flight_end(c)
    pale = 1.0 if math.isfinite(c.completed) else 0.35
    ax.broken_barh([(c.issued * ms, (done - c.issued) * ms)], (y - 0.25, 0.5), facecolor=color, alpha=pale)
    ax.plot([done * ms, c.wait_ended * ms], [y, y], color=color, lw=1)
    ax.text(c.issued * ms, y - 0.3, c.unit, fontsize=7, va="bottom", clip_on=True)


def _draw_step(ax, t: StepTimeline, span: float) -> None:
    ms = 1e3
    ax.broken_barh([(a * ms, (b - a) * ms) for a, b in running_segments(t)], (-0.3, 0.6), facecolor="0.65")
    rows = communication_rows(t, label_width=span / 150)
    for c, row in zip(t.collectives, rows):
        _draw_collective(ax, c, 1 + row)
    ax.axvline(t.backward_start * ms, color="black", ls="--", lw=1)
    ax.text(t.backward_start * ms, -0.45, " backward", fontsize=8, va="bottom")
    ax.text(0, -0.45, "forward", fontsize=8, va="bottom")
    n_rows = max(rows, default=0) + 1
    ax.set_yticks(range(n_rows + 1), ["compute (host thread)", "communication", *[""] * (n_rows - 1)])
    ax.set_ylim(n_rows + 0.5, -0.9)
    ax.set_title(
        f"{t.label}: step {_ms(t.end)}, blocked in waits {_ms(t.blocked())} "
        f"({100 * t.blocked() / t.end:.0f}%), {t.strategy}, rank {t.rank} of {t.world_size}",
        fontsize=10,
        loc="left",
    )


def _legend_handles():
    return [
        Patch(facecolor="0.65", label="running (compute, Python)"),
        Patch(facecolor="white", edgecolor="0.3", hatch="////", label="blocked in a wait"),
        Patch(facecolor=KIND_COLORS[ALL_GATHER], label="all-gather in flight"),
        Patch(facecolor=KIND_COLORS[REDUCE_SCATTER], label="reduce-scatter in flight"),
        Patch(facecolor=KIND_COLORS[REDUCE_SCATTER], alpha=0.35, label="end not reported: up to its wait"),
        Line2D([], [], color="0.3", lw=1, label="done, not yet waited for"),
    ]


def draw_timelines(timelines: Iterable[StepTimeline]):
    """One panel per recorded step, on a shared time axis (ms): a matplotlib Figure."""
    check(Figure is not None, "draw_timelines draws with matplotlib, which is not installed here.",
          "pip install matplotlib (or the notebooks extra: pip install -e '.[notebooks]').")
    timelines = list(timelines)
    fig = Figure(figsize=(12, 0.8 + 2.2 * len(timelines)))
    axes = fig.subplots(len(timelines), 1, sharex=True, squeeze=False)[:, 0]
    span = max(t.end for t in timelines)
    for ax, t in zip(axes, timelines):
        _draw_step(ax, t, span)
    axes[-1].set_xlim(0, span * 1e3 * 1.01)
    axes[-1].set_xlabel("ms since the step started")
    fig.legend(handles=_legend_handles(), loc="upper center", ncol=3, frameon=False, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))
    return fig
