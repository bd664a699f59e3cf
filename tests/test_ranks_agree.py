"""Ranks may feed inputs of different shapes; where their steps would issue different collectives, or a
collective helper is called on some ranks only, every rank that can raises an FSDPError in bounded time.

No bound here depends on this machine's speed: what is held is the order of events (the error comes before any
collective of the step) and limits well below the pool's gloo timeout (120 s), which a rank stuck in a collective
would wait out (a recompile on a loaded 2-core machine is seconds to tens of seconds)."""

import pytest

from tests import agreement_cases as cases
from tests.rank_pool import COLLECTIVE_TIMEOUT_S as GLOO_TIMEOUT_S


@pytest.mark.parametrize("strategy", ["zero3"])
def test_ranks_with_different_input_shapes_train_like_one_process(ranks, strategy):
    results = ranks(2).run(cases.ragged_inputs_train, strategy)
    for rank, r in enumerate(results):
        assert r["loss_rel_err"] < 1e-5, (rank, r)
        assert r["param_rel_err"] < 1e-5, (rank, r)
        assert r["compiles"] == 2, (rank, r)  # its own two shapes: a variant each, compiled on this rank alone
        assert r["step_checks_per_forward"] == [1, 1, 1], (rank, r)
        assert r["check_comes_first"] and r["check_printed"], (rank, r)


def test_steps_with_different_collectives_raise_on_every_rank(ranks):
    results = ranks(2).run(cases.different_collectives_at_a_later_step, timeout=300)
    for rank, r in enumerate(results):
        m = r["message"]
        assert "issue different collectives" in m and "first difference, forward collective #" in m, (rank, m)
        assert "'extra.weight'" in m or "'extra.bias'" in m, (rank, m)  # the unit only rank 1's step gathers
        assert "What to do" in m, (rank, m)
        assert r["collectives_before_the_error"] == [], (rank, r)  # raised before the step's first collective
        assert r["seconds"] < GLOO_TIMEOUT_S - 20, (rank, r)
        assert r["group_still_works"], (rank, r)


def test_helper_called_on_one_rank_fails_in_bounded_time(ranks):
    rank0, rank1 = ranks(2).run(cases.helper_on_one_rank, 3.0, timeout=300)
    m = rank0["message"]
    assert "full_state_dict()" in m and "rank 1 has entered no collective helper" in m, m
    assert "What to do" in m, m
    assert 3.0 <= rank0["seconds"] < GLOO_TIMEOUT_S - 20, rank0  # its own 3 s timeout, not gloo's
    assert rank1["message"] == "not called"
    assert rank0["later_helper_works"] and rank1["later_helper_works"]


def test_late_arrival_at_a_helper_raises_too(ranks):
    messages = ranks(2).run(cases.late_arrival, 2.0, timeout=300)
    assert "rank 1 has entered no collective helper" in messages[0], messages[0]
    assert "after another rank had stopped waiting" in messages[1], messages[1]
