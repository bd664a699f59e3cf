"""Initial weights (broadcast, meta device) and full state dicts, across gloo ranks."""

import pytest

from tests import rank_cases


@pytest.mark.parametrize("model_name", ["gpt2_tied", "odd_shapes"])
def test_full_state_dict_round_trip(ranks, model_name):
    for r in ranks(2).run(rank_cases.state_dict_round_trip, model_name, "zero3"):
        assert r["same_keys"] and r["exact_save"] and r["exact_round_trip"], r
        assert r["params_still_in_optimizer"] and r["module_methods_exact"], r
        assert r["out_rel_err"] < 1e-6, r


def test_broadcast_from_rank0(ranks):
    assert ranks(2).run(rank_cases.broadcast_from_rank0) == [True, True]


@pytest.mark.parametrize(("strategy", "broadcast_from"), [("zero2", None), ("zero3", 0)])
def test_meta_device_model(ranks, strategy, broadcast_from):
    """Each rank's shards are its rows of one tensor: the CPU build's with the seed every rank used (or rank 0's,
    broadcast), and the model computes as that build does."""
    for r in ranks(2).run(rank_cases.meta_device_init, strategy, broadcast_from):
        assert r == {"devices": ["cpu"], "finite": True, "grads": True, "shards_cut_from_one_tensor": True,
                     "gathered_is_that_tensor": True, "loss_as_that_model": True}, r
