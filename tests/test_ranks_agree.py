"""Ranks may feed inputs of different shapes; where their steps would issue different collectives, or a
collective helper is called on some ranks only, every rank that can raises an FSDPError in bounded time.

No bound here depends on this machine's speed: what is held is the order of events (the error comes before any
mismatched collective of the step: at most its first, the same on every rank) and limits well below the pool's gloo timeout (120 s), which a rank stuck in a collective
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
        assert r["seconds"] < GLOO_TIMEOUT_S - 20, (rank, r)
        assert r["group_still_works"], (rank, r)
    # raised before any mismatched collective: the one issued (beside the check's exchange) is the step's first,
    # the gather of inp.weight (16 x 16 float32), the same on both ranks
    issued = [r["collectives_before_the_error"] for r in results]
    assert issued[0] == issued[1] == [("all-gather", 16 * 16 * 4)], issued


def test_ranks_that_change_their_first_collective_together_train_then_diverge_later(ranks):
    """The step's first collective changes on every rank alike (steps 1 and 2: a stand-in of the agreed one is
    issued, then the exchange agrees) and training matches one process; at step 3 rank 1 alone changes it: both
    raise, each having issued the same one collective (rank 1 the stand-in, rank 0 its own gather)."""
    results = ranks(2).run(cases.first_collective_changes_then_ranks_diverge, timeout=300)
    for rank, r in enumerate(results):
        assert r["param_err"] < 1e-6, (rank, r)
        m = r["message"]
        assert "issue different collectives" in m and "first difference, forward collective #0" in m, (rank, m)
        assert "of unit 'pre." in m and "of unit 'inp." in m, (rank, m)
        assert r["seconds"] < GLOO_TIMEOUT_S - 20, (rank, r)
        assert r["group_still_works"], (rank, r)
    # rank 0 gathered inp's weight or bias (its step's first), rank 1 issued a stand-in of the same size
    issued = [r["collectives_before_the_error"] for r in results]
    assert issued[0] == issued[1] and issued[0] in ([("all-gather", 24 * 16 * 4)], [("all-gather", 24 * 4)]), issued


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
