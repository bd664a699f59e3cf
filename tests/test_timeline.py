"""The step timeline (:mod:`fsdp_pass.report.timeline`) and the completion times it reads off ``fsdp_comm``.

Tier 1 (one process): the executor stamps a collective's completion from its work's future without
changing how long its buffers live; running/blocked segments, row packing, tables and the drawing of a
hand-made timeline. Tier 2 (2 gloo ranks): a recorded step of the main job's model names every
collective of the final traces, in order, with consistent times.
"""

import gc
import io
import math
import time
import weakref
from types import SimpleNamespace

import pytest
import torch
from fsdp_pass_executors import collectives as comm

from fsdp_pass import Schedule
from fsdp_pass.compiled_step import CompiledStep
from fsdp_pass.plan.options import FSDPOptions
from fsdp_pass.report import timeline
from fsdp_pass.report.overlap import OverlapReport
from fsdp_pass.report.timeline import StepTimeline, TimedCollective
from fsdp_pass.op_names import ALL_GATHER, REDUCE_SCATTER

NAN = float("nan")


# -------------------------------------------------------------------------- completion in the executor
class _FutureWork:
    """A collective whose work reports completion through a future, finished by the test."""

    def __init__(self):
        self.future = torch.futures.Future()

    def get_future(self):
        return self.future

    def wait(self):
        return True


class _WorkWithoutFuture:
    def wait(self):
        return True


class _WorkWhoseFutureRaises(_WorkWithoutFuture):
    def get_future(self):
        raise RuntimeError("Work::getFuture not implemented.")


def test_completion_is_stamped_when_the_work_finishes_and_buffers_live_as_before():
    work, send = _FutureWork(), torch.arange(6.0)
    alive = weakref.ref(send)
    comm.WAIT_CLOCK.reset(record=True)
    try:
        flight = comm._issue(lambda o, i: work, torch.empty(12), send, ALL_GATHER)
        del send
        gc.collect()
        assert alive() is not None, "the send buffer was freed while its collective is in flight"
        before = time.perf_counter()
        work.future.set_result(None)  # the collective finishes: the stamp runs now, on this thread
        after = time.perf_counter()
        comm._wait_impl(flight)
        gc.collect()
        assert alive() is None, "the send buffer outlived its collective's wait"
        assert flight.completion is None  # nothing of the collective is kept past its wait
        (event,) = comm.WAIT_CLOCK.events
    finally:
        comm.WAIT_CLOCK.reset()
    assert before <= event.completed <= after
    assert event.issued <= event.completed <= event.wait_started <= event.wait_ended


@pytest.mark.parametrize("work", [_WorkWithoutFuture(), _WorkWhoseFutureRaises()], ids=["no future", "raises"])
def test_completion_is_nan_when_the_work_cannot_say(work):
    comm.WAIT_CLOCK.reset(record=True)
    try:
        comm._wait_impl(comm._issue(lambda o, i: work, torch.empty(4), torch.ones(2), REDUCE_SCATTER))
        (event,) = comm.WAIT_CLOCK.events
    finally:
        comm.WAIT_CLOCK.reset()
    assert math.isnan(event.completed) and event.issued <= event.wait_started <= event.wait_ended


def test_nothing_is_attached_to_a_collective_when_not_recording():
    comm.WAIT_CLOCK.reset()
    work = _FutureWork()
    flight = comm._issue(lambda o, i: work, torch.empty(4), torch.ones(2), ALL_GATHER)
    assert flight.completion is None
    comm._wait_impl(flight)
    assert comm.WAIT_CLOCK.events is None and comm.WAIT_CLOCK.waits == 1


# ------------------------------------------------------------------------ a hand-made timeline (ms)
def _collective(phase, kind, unit, issued, completed, wait_started, wait_ended):
    return TimedCollective(phase, kind, unit, 10, issued / 1e3, completed / 1e3, wait_started / 1e3, wait_ended / 1e3)


def _timeline(label="prefetch", end_ms=10.0):
    collectives = (
        _collective("forward", ALL_GATHER, "a", 1.0, 2.0, 3.0, 3.5),
        _collective("forward", ALL_GATHER, "b", 1.5, 4.0, 4.5, 5.0),
        _collective("backward", REDUCE_SCATTER, "a", 6.0, NAN, 8.0, 9.0),
    )
    return StepTimeline(label, 0, 2, "zero3", 5.5 / 1e3, end_ms / 1e3, collectives, OverlapReport(()))


def _ms(segments):
    return [(round(a * 1e3, 6), round(b * 1e3, 6)) for a, b in segments]


def test_the_host_thread_runs_except_when_blocked_in_a_wait():
    t = _timeline()
    assert _ms(timeline.running_segments(t)) == [(0, 3.0), (3.5, 4.5), (5.0, 8.0), (9.0, 10.0)]
    assert t.blocked() == pytest.approx(2e-3)
    assert t.blocked("forward") == pytest.approx(1e-3) and t.blocked("backward") == pytest.approx(1e-3)


def test_collectives_in_flight_together_get_different_rows():
    # a is in flight (with its label) until 3.5 ms, so b, issued at 1.5 ms, needs a second row; the
    # reduce-scatter, issued at 6 ms, fits in the first again
    assert timeline.communication_rows(_timeline(), label_width=0.1e-3) == [0, 1, 0]
    # a long label keeps its row busy past the wait
    assert timeline.communication_rows(_timeline(), label_width=10e-3) == [0, 1, 2]


def test_tables_compare_steps_side_by_side():
    fast, slow = _timeline("prefetch=1"), _timeline("prefetch=0", end_ms=20.0)
    table = timeline.compare_timelines([fast, slow]).splitlines()
    assert table[0].split()[:3] == ["schedule", "step", "forward"]
    assert table[2].split()[:3] == ["prefetch=1", "10.00", "ms"] and "2.00 ms" in table[2] and "20%" in table[2]
    assert table[3].startswith("prefetch=0") and "10%" in table[3]
    partial = StepTimeline("no backward", 0, 2, "zero3", 0.0055, 0.01, fast.collectives[:2], OverlapReport(()))
    rows = timeline.blocked_by_collective([fast, partial]).splitlines()[2:]
    assert [r.split()[:3] for r in rows] == [
        ["forward", ALL_GATHER, "a"],
        ["forward", ALL_GATHER, "b"],
        ["backward", REDUCE_SCATTER, "a"],
    ]
    assert rows[0].split()[3:] == ["0.50", "ms", "0.50", "ms"] and rows[2].split()[3:] == ["1.00", "ms", "-"]


def test_drawing_shows_every_collective_on_one_time_axis():
    fig = timeline.draw_timelines([_timeline("prefetch=1"), _timeline("prefetch=0", end_ms=20.0)])
    axes = fig.axes
    assert len(axes) == 2 and axes[0].get_xlim() == axes[1].get_xlim() and axes[0].get_xlim()[1] >= 20.0
    labels = [t.get_text() for t in axes[0].texts]
    assert labels.count("a") == 2 and labels.count("b") == 1 and " backward" in labels
    assert axes[0].get_title(loc="left").startswith("prefetch=1: step 10.00 ms, blocked in waits 2.00 ms (20%)")
    # one running lane, and per collective a blocked segment and an in-flight bar (pale: end unknown)
    bars = list(axes[0].collections)
    assert len(bars) == 1 + 2 * 3
    assert sum(1 for c in bars if c.get_alpha() == pytest.approx(0.35)) == 1
    fig.savefig(io.BytesIO(), format="png")


def test_recorded_events_must_match_the_traces():
    empty = SimpleNamespace(bound_symbols=[])
    step = CompiledStep(plan=None, options=FSDPOptions(), forward=empty, backward=empty)
    event = comm.CollectiveEvent(ALL_GATHER, 4, 1.0, 2.0, 3.0, 1.5)
    with pytest.raises(RuntimeError, match="the step issued"):
        timeline.name_events([event], step, 0.0)


# --------------------------------------------------------------------------- a real step, 2 gloo ranks
EXPECTED = [  # TinyLM, 2 layers, ZeRO-3: every unit gathered in the forward; the blocks again in the backward
    ("forward", ALL_GATHER, "embed+pos"),
    ("forward", ALL_GATHER, "layers.0"),
    ("forward", ALL_GATHER, "layers.1"),
    ("forward", ALL_GATHER, "norm+head"),
]


def test_a_recorded_step_names_every_collective_of_the_final_traces(ranks):
    per_rank = ranks(2).run(timeline.step_timelines, {"default": Schedule()}, width=64, recorded_steps=2)
    for rank, timelines in enumerate(per_rank):
        t = timelines["default"]
        assert (t.rank, t.world_size, t.strategy) == (rank, 2, "zero3")
        got = [(c.phase, c.kind, c.unit) for c in t.collectives]
        assert got[:4] == EXPECTED
        backward = sorted(got[4:])
        assert backward == sorted(
            [("backward", ALL_GATHER, u) for u in ("layers.1", "layers.0")]
            + [("backward", REDUCE_SCATTER, u) for u in ("norm+head", "layers.1", "layers.0", "embed+pos")]
        )
        # the static report reads the same traces: same collectives, same order
        assert [(r.phase, r.kind, r.unit) for r in t.overlap.rows] == got
        assert [c.numel for c in t.collectives[:4]] == [6144, 41088, 41088, 4160]
        for c in t.collectives:
            assert 0 <= c.issued <= c.wait_started <= c.wait_ended <= t.end
            in_phase = c.wait_ended <= t.backward_start if c.phase == "forward" else c.issued >= t.backward_start
            assert in_phase, c
            if c.kind == ALL_GATHER:  # gloo's all-gather work has a future; its reduce-scatter has none
                assert c.issued <= c.completed <= t.end
        assert t.blocked() == pytest.approx(sum(c.blocked for c in t.collectives))
