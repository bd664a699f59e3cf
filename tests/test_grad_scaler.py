"""float16's loss scaler on sharded gradients (``fsdp_pass.GradScaler``, :mod:`fsdp_pass.train.grad_scaler`): an
overflow in one rank's gradient shard skips the step on every rank, as one process skips it, and the scale backs
off on every rank; torch's own GradScaler, which checks only this rank's shard, lets the other rank step."""

from tests import scaler_cases


def test_an_overflow_in_one_shard_skips_the_step_on_every_rank(ranks):
    results = ranks(2).run(scaler_cases.overflow_on_one_rank, "llama_gqa", "zero3", steps=4, overflow_at=1)
    for r in results:
        assert r["stepped"] == r["ref_stepped"] == [True, False, True, True], r
        assert r["scales"] == r["ref_scales"], r  # backed off once (2**10 -> 2**9), on every rank
        assert r["scales"][1] == scaler_cases.SCALE / 2, r
        assert r["param_rel_err"] < 1e-5, r  # the same weights as one process, skipped step included
    # torch's GradScaler: rank 0 found the inf in its shard and skipped; rank 1 found none and stepped
    assert [r["torch_scaler_stepped"] for r in results] == [False, True]
