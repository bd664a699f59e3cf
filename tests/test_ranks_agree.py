"""Ranks may feed inputs of different shapes; where their steps would issue different collectives, or a
collective helper is called on some ranks only, every rank that can raises an FSDPError in bounded time.

No bound here depends on this machine's speed: what is held is the order of events (the error comes before any
mismatched collective of the step: at most its first, the same on every rank) and limits well below the pool's gloo timeout (120 s), which a rank stuck in a collective
would wait out (a recompile on a loaded 2-core machine is seconds to tens of seconds)."""

import pytest

from fsdp_pass.verify.rank_differences import DIFFERENT_TODO, PLANS_TODO, describe_difference
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


RAGGED_FIRST = {
    "default units": (cases.ragged_first_batches_train, ("zero3",), {}),
    "auto": (cases.ragged_first_batches_train, ("auto",), {"memory_budget": cases.AUTO_BUDGET}),
    "functional path": (cases.ragged_first_batches_functional, (), {}),
}


@pytest.mark.parametrize("how", list(RAGGED_FIRST))
def test_ranks_whose_first_batches_differ_plan_once_and_train_like_one_process(ranks, how):
    """Planned alone, each rank's first step would give another plan (asserted: else the test shows nothing); every
    rank plans from the same step instead (the one holding the most for the backward: rank 1's), at its first compile,
    and its later variant (at step 1 the ranks swap shapes) keeps that plan."""
    fn, args, kwargs = RAGGED_FIRST[how]
    results = ranks(2).run(fn, *args, **kwargs)
    alone = [r["alone"] for r in results]
    assert alone[0] != alone[1], alone  # the shapes make a lone rank choose otherwise
    for rank, r in enumerate(results):
        assert all(p == alone[1] for p in r["plans"]), (rank, r["plans"], alone)  # rank 1's step, on every rank
        assert r["loss_rel_err"] < 1e-5, (rank, r)
        assert max(r["grad_rel_err"].values()) < 1e-5, (rank, r["grad_rel_err"])
        assert len(r["grad_rel_err"]) == 11, (rank, sorted(r["grad_rel_err"]))  # every parameter compared
        if "param_rel_err" in r:
            assert r["param_rel_err"] < 1e-5 and r["compiles"] == 2, (rank, r)
            assert "planned from rank 1's first step" in r["explain"], r["explain"]


def test_first_steps_that_read_different_parameters_raise_on_every_rank_at_the_first_compile(ranks):
    """The agreement on the step to plan from sees it first: the same error on every rank, no collective issued."""
    results = ranks(2).run(cases.different_parameters_at_the_first_step, timeout=300)
    assert results[0]["message"] == results[1]["message"]
    for rank, r in enumerate(results):
        m = r["message"]
        assert "first steps read different parameters" in m and "at group #1 (rank 0: head." in m, (rank, m)
        assert "; rank 1: extra." in m, (rank, m)  # the layer only rank 1's longer batch goes through
        assert "What to do" in m and r["collectives_before_the_error"] == [], (rank, r)
        assert r["seconds"] < GLOO_TIMEOUT_S - 20 and r["group_still_works"], (rank, r)


def test_the_error_says_when_the_ranks_plans_differ_rather_than_blame_the_model():
    """Should two ranks ever plan differently, the cross-rank check's error says so, not that the model branches."""
    ours = {"forward": ("all-gather of unit 'a..c': 96 x float32",), "backward": (),
            "plan": ("unit 'a..c': 3 parameter(s), kept after forward, checkpoint none", "schedule S")}
    theirs = {"forward": ("all-gather of unit 'a..b': 64 x float32", "all-gather of unit 'c': 32 x float32"),
              "backward": (), "plan": ("unit 'a..b': 2 parameter(s), reshards after forward, checkpoint none",
                                       "unit 'c': 1 parameter(s), kept after forward, checkpoint none", "schedule S")}
    message, todo = describe_difference([ours, theirs])
    assert message.startswith("rank 0 and rank 1 planned differently") and "not your model's doing" in message
    assert ("first difference of the plans: rank 0 unit 'a..c': 3 parameter(s), kept after forward, checkpoint none; "
            "rank 1 unit 'a..b': 2 parameter(s)") in message, message
    assert "forward collective #0: rank 0 all-gather of unit 'a..c'" in message and todo == PLANS_TODO
    # the same plan, different collectives: the model's (its branch on the input), as before
    message, todo = describe_difference([ours, {**theirs, "plan": ours["plan"]}])
    assert "issue different collectives (their inputs may differ in shape" in message and todo == DIFFERENT_TODO
    assert describe_difference([ours, dict(ours)]) is None


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
