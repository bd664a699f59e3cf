"""``units=`` left out: the step model chooses the units (fsdp_pass/search/default_units.py, issue 40 item 1).

One dry run with the default units (test_explain's model at 2 ranks) and the shared one with ``units="blocks"``
(test_explain's); everything else prices candidates on the dry run's step summary, without compiling. The gloo
parity of the default units: tests/test_parity.py::test_parity_default_units.

Measured, not only predicted: on 2 gloo ranks the default's step and one unit's (a candidate the step model
predicts faster and rejects for its peak) are run and their step peaks measured (torch's profiler), which the
machine's load does not move; their order must be the step model's, and the default's peak at most one unit per
block's (measured 1,287,048 B against 1,439,056 B for one unit; the traces predict 1,287,040 B). Their step TIMES
are not held to the step model's order, because no honest measurement of them can be made here: the step model puts
one unit 2.4 ms (a third) ahead of the default's 7.6 ms on this model, while these steps on 2 gloo ranks of this
2-core machine, shared with other jobs (load about 11), took 0.32-0.50 s (the default) and 0.25-1.73 s (one unit,
over two runs), up to 7x apart from one step to the next: the ranks wait for cores, not for each other, and the
load decides the order. A time order needs a quiet machine of its own (bench.default_peak and bench.gpu measure
there).
"""

from dataclasses import replace

import pytest

from fsdp_pass import FSDP, FSDPError
from fsdp_pass.cost.cost_model import DEFAULTS
from fsdp_pass.search.default_units import StepModelUnits, candidate, choose_units
from fsdp_pass.cost.step_model import predict
from fsdp_pass.plan.unit_policies import Blocks
from fsdp_pass.search.unit_search import block_starts
from fsdp_pass.text import human_bytes
from tests import explain_cases, tolerances
from tests.dry_runs import model_dry_run

CPU = DEFAULTS["cpu-gloo"]


@pytest.fixture(scope="module")
def default():
    return model_dry_run(2, "zero3", units=None)


@pytest.fixture(scope="module")
def blocks():
    return model_dry_run(2, "zero3")  # units="blocks" (tests/dry_runs.py), test_explain's


def _neighbours(starts, n):
    """Every merge of two neighbouring units and every split of a unit at one of its pieces."""
    for u in range(1, len(starts)):
        yield starts[:u] + starts[u + 1:]
    for cut in range(1, n):
        if cut not in starts:
            yield tuple(sorted((*starts, cut)))


def test_the_default_units_are_the_step_models_fastest_within_blocks_peak(default, blocks):
    plan = default.fsdp.compiled_step.plan
    summary, choice = plan.summary, plan.units_choice
    assert plan.policy == "step_model" and choice.cost == CPU and choice.budget is None  # the CPU: no bound
    starts = tuple(sorted({min(i for i, p in enumerate(summary.pieces) if set(p.params) & set(u.params))
                           for u in plan.units}))
    options = default.fsdp.compiled_step.options

    def zero3(units):  # ZeRO-3 over these units, the last one resharded where the step model predicts less peak
        return candidate(units, options, summary)

    # the compiled plans reshard as the priced candidates do (ZeRO-3's last unit: search.last_unit, both plans)
    assert tuple(u.reshard_after_forward for u in plan.units) == zero3(starts).reshard
    assert tuple(u.reshard_after_forward for u in blocks.explanation.plan.units) == zero3(block_starts(summary)).reshard
    chosen = predict(summary, zero3(starts), CPU)
    # the compiled plan is the one priced: no slower than one unit per block, its peak no higher
    assert default.predict_step("cpu-gloo").step_s == pytest.approx(chosen.step_s)
    per_block = predict(summary, zero3(block_starts(summary)), CPU)
    assert blocks.predict_step("cpu-gloo").step_s == pytest.approx(per_block.step_s)
    assert chosen.step_s <= per_block.step_s and chosen.peak_bytes <= per_block.peak_bytes
    # no single merge or split of the chosen units that keeps within that peak is predicted faster (the greedy
    # search's end)
    n = len(summary.pieces)
    for s in _neighbours(starts, n):
        other = predict(summary, zero3(s), CPU)
        assert other.peak_bytes > per_block.peak_bytes or other.step_s >= chosen.step_s * (1 - 1e-3), s


def test_the_default_never_predicts_a_peak_above_one_unit_per_blocks(default):
    """Memory first: with the CPU's cost inputs or an H100's, without a bound or within an 80 GiB device, the chosen
    units' predicted peak is at most one unit per block's. On this model the fastest units found without that bound
    peak higher (so the bound decides something: main chose them), and the choice says what it gave up."""
    plan = default.fsdp.compiled_step.plan
    summary, options = plan.summary, default.fsdp.compiled_step.options
    for cost in (CPU, DEFAULTS["h100-nvlink"]):
        for device_memory in (None, 80 << 30):
            choice = choose_units(summary, options, cost, device_memory)
            assert choice.prediction.peak_bytes <= choice.blocks.peak_bytes, (cost.source, device_memory)
    choice = choose_units(summary, options, CPU, None)
    assert choice.fastest is not None and choice.fastest.peak_bytes > choice.blocks.peak_bytes
    assert choice.fastest.step_s < choice.prediction.step_s
    text = str(default.explanation)
    assert ("memory first: kept within one unit per block's predicted peak, "
            f"{human_bytes(choice.blocks.peak_bytes)}; the fastest units found ({choice.fastest_units}) would step in "
            f"{choice.fastest.step_s * 1e3:.3g} ms but peak at {human_bytes(choice.fastest.peak_bytes)}") in text, text


def test_explain_prints_the_chosen_units_and_why(default, blocks):
    text = str(default.explanation)
    choice = default.fsdp.compiled_step.plan.units_choice
    assert "units: chosen by the step model for cpu-gloo (units='blocks' gives one per block)" in text
    assert f"predicted step {choice.prediction.step_s * 1e3:.3g} ms vs blocks {choice.blocks.step_s * 1e3:.3g} ms" in text
    assert ", ".join(u.name for u in default.explanation.units) in text
    assert "units: chosen" not in str(blocks.explanation)


def test_units_blocks_is_todays_plan(blocks):
    plan = blocks.fsdp.compiled_step.plan
    assert plan.policy == "blocks" and plan.units_choice is None
    # one unit per block (test_explain's model: 2 layers), the embedding before them, the norm and head after
    names = [u.name for u in plan.units]
    assert names[1:3] == ["model.layers.0", "model.layers.1"] and len(names) == 4, names
    assert "embed" in names[0] and "lm_head" in names[3], names
    assert isinstance(FSDP("zero3", units="blocks").options.unit_policy, Blocks)
    assert isinstance(FSDP("zero3").options.unit_policy, StepModelUnits)


def test_the_choice_fits_the_budget_and_keeps_blocks_where_it_cannot_price(default):
    plan = default.fsdp.compiled_step.plan
    summary, options = plan.summary, default.fsdp.compiled_step.options
    free = choose_units(summary, options, CPU, None)
    assert free.groups == plan.units_choice.groups  # a pure function of the summary, options and cost inputs
    budget = free.blocks.peak_bytes * 95 // 100  # a device smaller than one unit per block's peak: the bound is it
    bound = choose_units(summary, options, CPU, budget)
    assert bound.bound == budget and bound.prediction.peak_bytes <= budget < free.prediction.peak_bytes
    for unpriced in (replace(options, schedule=None), replace(options, reshard_after_forward=lambda u: True)):
        kept = choose_units(summary, unpriced, CPU, None)
        assert kept.prediction is None and kept.reasons[0].startswith("kept: ")


def test_cost_is_the_users_and_only_with_units_left_out():
    assert FSDP("zero3", cost="h100-nvlink").options.unit_policy.cost == DEFAULTS["h100-nvlink"]
    with pytest.raises(FSDPError, match="read by the auto planner only"):
        FSDP("zero3", units="blocks", cost="h100-nvlink")


def _starts(plan) -> tuple[int, ...]:
    """The first piece of the step summary in each of ``plan``'s units: the units as a candidate names them."""
    pieces = plan.summary.pieces
    return tuple(sorted({min(i for i, p in enumerate(pieces) if set(p.params) & set(u.params)) for u in plan.units}))


def test_the_step_models_order_of_peaks_holds_measured_on_two_gloo_ranks(ranks, default, blocks):
    """The default's units and one unit holding the whole model, each compiled and stepped on 2 gloo ranks: the
    step model's order of their peaks is the measured order (one unit above the default, by far more than the
    profiler's error), and the default's measured step peak is at most one unit per block's (its traced peak, which
    test_explain holds within 1 KiB of its measured one): memory first, measured."""
    plan = default.fsdp.compiled_step.plan
    summary, options = plan.summary, default.fsdp.compiled_step.options
    predicted = {name: predict(summary, candidate(starts, options, summary), CPU)
                 for name, starts in (("default", _starts(plan)), ("one", (0,)))}
    results = ranks(2).run(explain_cases.measured_candidates)
    for r in results:
        assert r["default"]["units"] == [u.name for u in plan.units] and len(r["one"]["units"]) == 1, r
        peak = {name: min(r[name]["measured_peaks"]) for name in predicted}
        assert peak["default"] <= blocks.explanation.memory.step.peak_bytes + tolerances.PEAK_BYTES, peak
        assert (predicted["one"].peak_bytes > predicted["default"].peak_bytes) == (peak["one"] > peak["default"])
        assert abs(peak["one"] - peak["default"]) > 10 * tolerances.PEAK_BYTES, peak
    assert predicted["one"].step_s < predicted["default"].step_s  # the faster candidate, rejected for its peak
