"""Tier 1: the scheduling pass, on final traces built in one process (fake group, world size 8).

Where each collective is issued and waited for: prefetch one unit ahead, waits right before first use,
reduce-scatters as soon as their input exists, the in-flight bounds, peak gathered memory, stability
across recompiles; the lifetime check that catches a buffer used while its collective is in flight;
and the executor keeping a collective's buffers alive until its wait.
"""

import gc
import itertools
import weakref

import pytest
import thunder
import torch
from fsdp_pass_executors import collectives as comm
from fsdp_pass_executors import executors_for
from thunder.core import prims
from thunder.core.trace import from_trace

from fsdp_pass import FSDP, FSDPError, Schedule, fake_process_group
from fsdp_pass.pipeline import reschedule
from fsdp_pass.report.overlap import is_compute, step_overlap
from fsdp_pass.predicates import (
    is_all_gather,
    is_collective,
    is_packing,
    is_reduce_scatter,
    is_unit_op,
    is_view_like,
    is_wait,
)
from fsdp_pass.report.step_stats import step_stats
from fsdp_pass.verify.collective_lifetimes import check_collective_lifetimes
from fsdp_pass.verify.same_collectives_on_all_ranks import collective_calls
from fsdp_pass.op_names import ALL_GATHER, REDUCE_SCATTER
from tests.llama_steps import LAYERS, WORLD, compile_step, shared_step


def block_bytes(fsdp) -> int:
    unit = next(u for u in fsdp.unit_plan.units if u.name == "layers.0")
    _, shard_numel, _ = fsdp.unit_plan.unit_numel(unit)
    return shard_numel * WORLD * fsdp.unit_plan.unit_itemsize(unit)


@pytest.fixture(scope="module")
def compiled():
    """name -> (forward, backward, FSDP transform or CompiledStep). Other schedules of the default compile are
    made by ``reschedule`` (stages 5-7 again on its lowered traces); one is compiled too, to show they agree, and
    that second compile's lowered traces under the default schedule stand for compiling the default again."""
    out = {"default": shared_step("zero3")}  # FSDP("zero3"): the default schedule
    step = out["default"][2].compiled_step
    limit = block_bytes(out["default"][2])
    out["prefetch2"] = compile_step(schedule=Schedule(prefetch=2))
    again = reschedule(out["prefetch2"][2].compiled_step, step.options.schedule)
    out["again"] = (again.forward, again.backward, again)
    for name, schedule in {
        "rescheduled_prefetch2": Schedule(prefetch=2),
        "bounded": Schedule(prefetch=2, max_unused_bytes=limit, reduce_scatters_in_flight=1),
        "prefetch0": Schedule(prefetch=0),
        "everything_first": Schedule(prefetch=8),  # every gather at the top
        "layers1_own_depth": Schedule(prefetch=1, prefetch_by_unit={"layers.1": 0, "layers.2": 2}),
    }.items():
        other = reschedule(step, schedule)
        out[name] = (other.forward, other.backward, other)
    out["zero2"] = shared_step("zero2")
    return out


# ------------------------------------------------------------------------------------ trace facts
def positions(trace, pred):
    return [i for i, b in enumerate(trace.bound_symbols) if pred(b)]


def wait_of(trace, issue_index):
    future = trace.bound_symbols[issue_index].output.name
    (w,) = [i for i, b in enumerate(trace.bound_symbols) if is_wait(b) and b.args[0].name == future]
    return w


def max_in_flight(trace, pred, weight=lambda b: 1):
    """The most (by count or ``weight``) collectives matching ``pred`` issued and not yet waited for."""
    live, peak, open_ = 0, 0, {}
    for b in trace.bound_symbols:
        if is_collective(b) and pred(b):
            open_[b.output.name] = weight(b)
            live += open_[b.output.name]
            peak = max(peak, live)
        elif is_wait(b) and b.args[0].name in open_:
            live -= open_.pop(b.args[0].name)
    return peak


def first_compute_reading(trace, w):
    """Index of the first compute op that reads the wait's result (directly, through views, or through the op
    that cuts it into parameters or gradient shards)."""
    aliases = {trace.bound_symbols[w].output.name}
    for i in range(w + 1, len(trace.bound_symbols)):
        b = trace.bound_symbols[i]
        if any(p.name in aliases for p in b.flat_proxy_args):
            if is_view_like(b) or is_unit_op(b):
                aliases.update(o.name for o in b.flat_proxy_outs)
            elif is_compute(b) or is_collective(b):
                return i
    return len(trace.bound_symbols)


def is_work(bsym) -> bool:
    """A compute op, not counting the packing of a collective's send buffer."""
    return is_compute(bsym) and not is_packing(bsym)


def compute_between(trace, a, b):
    return [x for x in trace.bound_symbols[a + 1 : b] if is_work(x)]


def gathers_by_first_use(trace):
    return sorted(positions(trace, is_all_gather), key=lambda c: wait_of(trace, c))


# ----------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("phase", [0, 1])
def test_each_wait_sits_right_before_first_use(compiled, phase):
    trace = compiled["default"][phase]
    bsyms = trace.bound_symbols
    for c in positions(trace, is_collective):
        w = wait_of(trace, c)
        use = first_compute_reading(trace, w)
        if is_reduce_scatter(bsyms[c]) and compute_between(trace, w, use):
            # waited early only to keep at most two reduce-scatters in flight: right before the next issue
            nxt = next(i for i in range(w + 1, len(bsyms)) if is_collective(bsyms[i]) or is_work(bsyms[i]))
            assert is_reduce_scatter(bsyms[nxt]) and max_in_flight(trace, is_reduce_scatter) == 2
            continue
        assert not compute_between(trace, w, use), f"compute between the wait at {w} and the first use at {use}"


@pytest.mark.parametrize("phase", [0, 1])
def test_prefetch_one_unit_ahead_in_use_order(compiled, phase):
    trace = compiled["default"][phase]
    gathers = gathers_by_first_use(trace)
    assert gathers == positions(trace, is_all_gather), "gathers are issued in the order their units are used"
    # gather k is issued right after gather k-1 arrives, before the compute of unit k-1 starts
    for prev, cur in itertools.pairwise(gathers):
        w_prev = wait_of(trace, prev)
        assert w_prev < cur < first_compute_reading(trace, w_prev)
        assert not compute_between(trace, w_prev, cur)
        assert compute_between(trace, cur, wait_of(trace, cur)), "the prefetched gather overlaps compute"
    assert max_in_flight(trace, is_all_gather) == 1


def test_zero2_gathers_every_kept_unit_at_the_top(compiled):
    """Under ZeRO-2 every unit stays gathered for the backward: waiting would save no memory."""
    forward, backward, _ = compiled["zero2"]
    gathers = positions(forward, is_all_gather)
    assert gathers == gathers_by_first_use(forward) and len(gathers) == LAYERS + 2
    first_work = next(i for i, b in enumerate(forward.bound_symbols) if is_work(b))
    assert gathers[-1] < first_work
    assert not positions(backward, is_all_gather)


def test_backward_gathers_run_in_reverse_unit_order(compiled):
    fsdp = compiled["default"][2]
    rows = fsdp.overlap_report().rows
    forward = [r.unit for r in rows if r.phase == "forward" and r.kind == ALL_GATHER]
    backward = [r.unit for r in rows if r.phase == "backward" and r.kind == ALL_GATHER]
    assert forward == ["embed", "layers.0", "layers.1", "layers.2", "norm+lm_head"]
    # zero3: the embedding's backward needs no weights; the last unit is gathered again where it reshards (the step
    # model's decision, search.last_unit: the tests' Llama's caller's loss on its 2 x 8 x 37 logits holds less than the
    # head's own backward, so it is kept)
    head = fsdp.compiled_step.plan.units[-1]
    assert backward == ["norm+lm_head"] * head.reshard_after_forward + ["layers.2", "layers.1", "layers.0"]


def test_reduce_scatters_issued_as_soon_as_their_input_exists(compiled):
    backward = compiled["default"][1]
    bsyms = backward.bound_symbols
    for c in positions(backward, is_reduce_scatter):
        flat = bsyms[c].flat_proxy_args[0].name
        (producer,) = [i for i, b in enumerate(bsyms) if any(o.name == flat for o in b.flat_proxy_outs)]
        assert not compute_between(backward, producer, c) and not any(is_collective(b) for b in bsyms[producer + 1 : c])
    # waited late, but at most two in flight (each keeps its full-size gradient buffer alive)
    assert max_in_flight(backward, is_reduce_scatter) == 2
    assert max_in_flight(compiled["bounded"][1], is_reduce_scatter) == 1


def test_only_each_phases_first_gather_and_the_last_reduce_scatter_are_exposed(compiled):
    exposed = [(r.phase, r.kind, r.unit) for r in compiled["default"][2].overlap_report().exposed()]
    # the backward's first gather, where the head reshards (see above), has nothing before it in the backward trace
    # to hide behind (the caller's loss ran its backward before the trace starts); kept, the first is layers.2's,
    # issued at the top and hidden behind the head's backward
    head = compiled["default"][2].compiled_step.plan.units[-1]
    first_backward = [("backward", ALL_GATHER, "norm+lm_head")] if head.reshard_after_forward else []
    assert exposed == [("forward", ALL_GATHER, "embed"), *first_backward, ("backward", REDUCE_SCATTER, "embed")]
    report = str(compiled["default"][2].overlap_report())
    assert "EXPOSED" in report and "matmul" in report and f"{len(exposed)} exposed" in report
    header, rule = report.splitlines()[:2]
    assert len(header) == len(rule), "every dashed column has a title"


def test_prefetch_zero_leaves_every_gather_exposed(compiled):
    rows = step_overlap(compiled["prefetch0"][2]).rows
    assert all(r.exposed for r in rows if r.kind == ALL_GATHER)


def test_deeper_prefetch_and_the_byte_bound(compiled):
    forward = compiled["prefetch2"][0]
    assert max_in_flight(forward, is_all_gather) == 2
    limit = block_bytes(compiled["default"][2])
    bounded = compiled["bounded"][0]

    def nbytes(b):
        return b.output.numel * b.output.dtype.bytes

    assert max_in_flight(bounded, is_all_gather, nbytes) <= limit
    assert max_in_flight(forward, is_all_gather, nbytes) > limit  # the bound changed something


@pytest.mark.parametrize("phase", [0, 1])
def test_a_unit_with_a_prefetch_depth_of_its_own(compiled, phase):
    """layers.1 is gathered right before its use, layers.2 two gathers ahead; the others one ahead, as by default."""
    trace, step = compiled["layers1_own_depth"][phase], compiled["layers1_own_depth"][2]
    gathers = gathers_by_first_use(trace)
    unit = [step.unit_of_collective[trace.bound_symbols[c].output.name] for c in gathers]
    assert {"layers.1", "layers.2"} <= set(unit)
    for k, c in enumerate(gathers):
        if unit[k] == "layers.1":
            assert not compute_between(trace, c, wait_of(trace, c)), "depth 0: issued right before its wait"
        elif unit[k] == "layers.2" and k >= 2:
            w = wait_of(trace, gathers[k - 2])  # issued right after the wait two gathers earlier
            assert w < c and not compute_between(trace, w, c)
        elif k >= 1 and unit[k - 1] != "layers.1":
            w = wait_of(trace, gathers[k - 1])
            assert w < c and not compute_between(trace, w, c)
            assert compute_between(trace, c, wait_of(trace, c)), "the others still overlap compute"


def test_peak_gathered_memory_is_bounded_by_units_not_the_model(compiled):
    fwd, bwd, fsdp = compiled["default"]
    peak = step_stats(fwd, bwd, WORLD).peak_gathered_bytes
    all_at_once = step_stats(*compiled["everything_first"][:2], WORLD).peak_gathered_bytes
    model_bytes = sum(fsdp.unit_plan.unit_numel(u)[1] * WORLD * 4 for u in fsdp.unit_plan.units)
    # prefetching every unit issues every gather at once: the whole model is gathered at the top
    assert all_at_once >= model_bytes
    # scheduled: two units' bytes at most (a gathered buffer and the parameters copied out of it, or the
    # parameters of the unit computing and the gather in flight), plus the norm weights the forward saves for
    # the backward (two per layer, 16 floats each)
    assert peak <= 2 * block_bytes(fsdp) + LAYERS * 2 * 16 * 4
    assert peak < all_at_once / 2


def test_reschedule_gives_what_compiling_with_that_schedule_gives(compiled):
    for phase in (0, 1):
        a, b = compiled["prefetch2"][phase], compiled["rescheduled_prefetch2"][phase]
        assert [x.sym.name for x in a.bound_symbols] == [x.sym.name for x in b.bound_symbols]
        assert collective_calls(a) == collective_calls(b)
        assert positions(a, is_wait) == positions(b, is_wait)
    assert compiled["rescheduled_prefetch2"][2].options.schedule == Schedule(prefetch=2)


def test_same_schedule_on_every_recompile(compiled):
    """A second compile (made with prefetch=2) scheduled like the first: the same collectives at the same places.
    Its lowered traces come from compiling the model again; the test above holds reschedule to a real compile."""
    assert compiled["again"][2].options.schedule == compiled["default"][2].options.schedule
    for phase in (0, 1):
        a, b = compiled["default"][phase], compiled["again"][phase]
        assert collective_calls(a) == collective_calls(b)
        assert positions(a, is_collective) == positions(b, is_collective)
        assert positions(a, is_wait) == positions(b, is_wait)


# ------------------------------------------------------------------------ in-flight buffer safety
def _with_bsyms(trace, bsyms):
    new = from_trace(trace)
    new.bound_symbols = bsyms
    return new


def test_lifetime_check_accepts_the_scheduled_traces(compiled):
    for name in ("default", "prefetch2", "bounded", "prefetch0", "everything_first", "zero2"):
        check_collective_lifetimes(compiled[name][0])
        check_collective_lifetimes(compiled[name][1])


def test_lifetime_check_catches_a_write_into_a_buffer_in_flight(compiled):
    forward = compiled["default"][0]
    bsyms = list(forward.bound_symbols)
    c = positions(forward, is_all_gather)[1]
    send = bsyms[c].flat_proxy_args[0]
    # overwrite the gather's send buffer while it is in flight
    bsyms.insert(c + 1, prims.copy_.bind(send, send, grad_enabled=False, output=send))
    with pytest.raises(FSDPError, match="writes into .* still in flight"):
        check_collective_lifetimes(_with_bsyms(forward, bsyms))


def test_lifetime_check_catches_a_wait_after_use_or_a_second_reader(compiled):
    forward = compiled["default"][0]
    bsyms = list(forward.bound_symbols)
    c = positions(forward, is_all_gather)[1]
    w = wait_of(forward, c)
    moved = bsyms[:c] + [bsyms[w]] + bsyms[c:w] + bsyms[w + 1 :]  # the wait before its collective
    with pytest.raises(FSDPError, match="before it is issued"):
        check_collective_lifetimes(_with_bsyms(forward, moved))
    twice = bsyms[: w + 1] + [bsyms[w]] + bsyms[w + 1 :]  # waited for twice
    with pytest.raises(FSDPError, match="read by 2 op"):
        check_collective_lifetimes(_with_bsyms(forward, twice))


class _LateWork:
    """A collective that has not finished: what it reads must stay alive until wait()."""

    waited = False

    def wait(self):
        self.waited = True


def test_executor_keeps_buffers_alive_until_the_wait():
    send = torch.arange(6.0)
    out = torch.empty(12)
    alive = weakref.ref(send)
    comm.WAIT_CLOCK.reset(record=True)
    flight = comm._issue(lambda o, i: _LateWork(), out, send, ALL_GATHER)
    del send
    gc.collect()
    assert alive() is not None, "the send buffer was freed while its collective is in flight"
    result = comm._wait_impl(flight)
    assert result is out and flight.work.waited and comm.WAIT_CLOCK.waits == 1
    gc.collect()
    assert alive() is None, "the send buffer outlived its collective's wait"
    # the timeline: one event, issued before its wait started, 12 gathered elements
    (event,) = comm.WAIT_CLOCK.events
    assert (event.kind, event.numel) == (ALL_GATHER, 12)
    assert event.issued <= event.wait_started <= event.wait_ended
    comm.WAIT_CLOCK.reset()


def test_schedule_settings_are_checked():
    with pytest.raises(FSDPError, match="prefetch"):
        Schedule(prefetch=-1)
    with pytest.raises(FSDPError, match="max_unused_bytes"):
        Schedule(max_unused_bytes=0)
    with pytest.raises(FSDPError, match="reduce_scatters_in_flight"):
        Schedule(reduce_scatters_in_flight=0)
    with pytest.raises(FSDPError, match="prefetch_by_unit"):
        Schedule(prefetch_by_unit={"layers.0": -1})
    assert Schedule(prefetch_by_unit={"b": 2, "a": 0}).prefetch_by_unit == (("a", 0), ("b", 2))
    assert Schedule(prefetch_by_unit={"b": 2}).prefetch_of("b") == 2 and Schedule().prefetch_of("b") == 1
    with pytest.raises(FSDPError, match="not a schedule"):
        FSDP("zero3", schedule="fast")
    assert FSDP("zero3", schedule=2).options.schedule == Schedule(prefetch=2)


def test_the_printed_trace_names_the_executor_of_each_collective(compiled):
    forward, backward, _ = compiled["default"]
    assert [e.name for e in executors_for("cpu")] == ["fsdp_comm", "cpu_attention", "torch"]
    for text in (str(forward), str(backward)):
        assert "fsdp_all_gather(" in text and "fsdp_wait(" in text and "torch_all_gather_prim_impl" not in text
    assert "fsdp_reduce_scatter(" in str(backward)


# ------------------------------------------------------------------- a loss computed inside the model
class _LossInside(torch.nn.Module):
    """Two tanh layers and a head, the cross-entropy computed in the forward (as a Hugging Face model fed labels):
    the backward starts with the loss's gradient, above the head's (kept) weight's first use. The forward starts
    with compute of no unit's (as a model's position tables or masks)."""

    def __init__(self, d=16, vocab=37):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(2))
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, x, y):
        x = torch.sin(x @ x.T) @ x
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return torch.nn.functional.cross_entropy(self.head(x), y)


def test_the_first_backward_gather_waits_for_the_loss_gradient():
    """ZeRO-3 with the head resharded too (asked: the forward computes the loss after it); the backward's first
    gather (the head's) is issued right before the first op computing with the head's weight, below the loss's gradient:
    issued at the top, its buffer would be live while the loss's gradient (the step's largest activations) is
    computed. The next (layers.1, prefetched) overlaps the head's backward. The forward's first gather stays at
    the top, overlapping the compute above the first unit."""
    torch.manual_seed(0)
    with fake_process_group(WORLD):  # every unit reshards, the head too (the step model would keep it: a tie)
        fsdp = FSDP("zero3", units="blocks", reshard_after_forward=True)
        jm = thunder.jit(_LossInside(), transforms=[fsdp], executors=executors_for("cpu"))
        jm(torch.randn(8, 16), torch.randint(0, 37, (8,))).backward()
    backward = fsdp.compiled_step.backward
    bsyms = backward.bound_symbols
    first, second = positions(backward, is_all_gather)[:2]
    unit_of = fsdp.compiled_step.unit_of_collective
    assert [unit_of[bsyms[i].output.name] for i in (first, second)] == ["head", "layers.1"]
    head = next(i for i, b in enumerate(bsyms) if is_work(b) and any(tuple(p.shape) == (37, 16) for p in
                                                                     b.flat_proxy_args))  # the head's weight
    assert first < head and not compute_between(backward, first, head), "issued right before the head's backward"
    assert compute_between(backward, -1, first), "below the loss's gradient"
    assert compute_between(backward, second, wait_of(backward, second)), "layers.1's overlaps the head's backward"
    forward = fsdp.compiled_step.forward
    first = positions(forward, is_all_gather)[0]
    assert compute_between(forward, first, wait_of(forward, first)), "the forward's first gather overlaps x @ x.T"
