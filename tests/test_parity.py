"""Tier 2: gloo ranks against a single-process reference: per-step loss and full gradients.

Final weights after AdamW are not compared element-wise: AdamW scales every update to about ``lr``,
so parameters whose true gradient is zero up to rounding (e.g. the key bias of attention, which
softmax ignores) move by noise in both runs. The loss at every step checks the trajectory instead.
"""

import pytest

from fsdp_pass import Schedule
from tests import rank_cases
from tests.models import MODELS, NON_ADJACENT_UNITS

TOL = 1e-5  # relative, float32


def _check(results, world_size):
    r = results[0]
    assert r["loss_rel_err"] < TOL, r
    assert r["grad_rel_err"] < TOL, r  # each parameter's gradient on its own
    assert r["losses"][-1] < r["losses"][0], f"loss did not fall: {r['losses']}"
    assert not r["frozen_grads_present"], "a frozen parameter received a gradient"
    for rank, x in enumerate(results):
        # each rank's own loss, before any reduction, is the reference's on that rank's slice of the batch
        assert x["local_loss_rel_err"] < TOL, (rank, x)
        # each holds exactly its rows of every parameter: ceil(rows / N) of them, padding included
        assert x["shard_numel"] == rank_cases.expected_shard_numel(x["full_shapes"], world_size), (rank, x)
        # and issues and waits for each collective where every other rank does
        assert x["schedule"] == r["schedule"], (rank, x["schedule"], r["schedule"])


# world 4 for the models where it changes something: padding rows on more ranks, a tied weight's shards
DEFAULT_UNIT_CASES = [(m, 2) for m in sorted(MODELS)] + [("odd_shapes", 4), ("gpt2_tied", 4)]


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
@pytest.mark.parametrize(("model_name", "world_size"), DEFAULT_UNIT_CASES)
def test_parity_default_units(ranks, model_name, strategy, world_size):
    results = ranks(world_size).run(rank_cases.parity, model_name, strategy)
    _check(results, world_size)
    # units= left out: the step model chose them (search.default_units), the same on every rank
    assert results[0]["units_choice"].startswith("units: chosen by the step model for cpu-gloo"), results[0]
    assert all(x["unit_names"] == results[0]["unit_names"] for x in results)


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_parity_explicit_non_adjacent_unit(ranks, model_name, strategy):
    units = NON_ADJACENT_UNITS[model_name]
    results = ranks(2).run(rank_cases.parity, model_name, strategy, units=units, reshard_after_forward=True)
    _check(results, 2)
    assert "+".join(units[0]) in results[0]["unit_names"]  # the explicit unit was built as asked


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_parity_per_parameter_units(ranks, model_name):
    _check(ranks(2).run(rank_cases.parity, model_name, "zero3", units="per_parameter"), 2)


SCHEDULES = {
    "unscheduled": None,
    "no_prefetch": Schedule(prefetch=0),
    "prefetch2_bounded": Schedule(prefetch=2, max_unused_bytes=1, reduce_scatters_in_flight=1),
    "prefetch3_unbounded_reductions": Schedule(prefetch=3, reduce_scatters_in_flight=None),
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("model_name", ["gpt2_tied", "llama_gqa"])
def test_parity_schedules(ranks, model_name, schedule):
    _check(ranks(2).run(rank_cases.parity, model_name, "zero3", schedule=SCHEDULES[schedule]), 2)


def test_parity_world_size_1(ranks):
    _check(ranks(1).run(rank_cases.parity, "gpt2_tied", "zero3", steps=3), 1)
