"""Tier 3, when a GPU is there (skipped without one): the same step on CUDA tensors, against one process.

Two gloo ranks share the one GPU (gloo carries CUDA tensors through the host), each jitted with
``executors_for("cuda")``: ``fsdp_comm``, Thunder's sdpa executor, a fusion executor (nvFuser, else Thunder's
torchcompile), torch. Each run checks the loss and the gradients against a single process on the GPU, that
the schedule survives the fusion (only the first forward all-gather has no compute before its wait), and
with ``offload_to="cpu"`` that the shards and their gradients stay on the host while the step computes on
the GPU; ``check_finite=True`` on offloaded shards names the parameter (its check ordered after the copy).
"""

from __future__ import annotations

import pytest
import torch

from fsdp_pass.op_names import ALL_GATHER
from tests import finite_cases, rank_cases, tolerances
from tests.test_check_finite import assert_nan_located

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="tier 3: needs a CUDA GPU")

CASES = {
    "zero3": ("zero3", {}),
    "zero2": ("zero2", {}),
    "zero3 offloaded": ("zero3", {"offload_to": "cpu"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_cuda_step_trains_like_one_process(ranks, case):
    strategy, options = CASES[case]
    results = ranks(2).run(rank_cases.parity, "llama_gqa", strategy, steps=3, device="cuda", **options)
    r = results[0]
    assert r["loss_rel_err"] < tolerances.CUDA and r["grad_rel_err"] < tolerances.CUDA, r  # each parameter's gradient
    first_gather = next(row[:3] for row in r["schedule"] if row[1] is ALL_GATHER)
    assert [e for e in r["exposed"] if e[0] == "forward"] == [first_gather], r["exposed"]
    host = ["cpu"] if "offload_to" in options else ["cuda:0"]
    for rank, x in enumerate(results):
        assert x["local_loss_rel_err"] < tolerances.CUDA, (rank, x)  # this rank's own loss on its slice
        # the shards, their gradients and AdamW's state: on the host when offloaded, else on the GPU
        where = (x["shard_devices"], x["grad_devices"], x["optimizer_state_devices"])
        assert where == (host, host, host), (rank, where)


def test_check_finite_names_the_parameter_of_an_offloaded_shard(ranks):
    """``check_finite=True`` with ``offload_to="cpu"``: a unit's packed shard is the host-to-device copy the executor
    runs on the communication stream, and the check reads it on that stream, after the copy (on the compute stream
    it would race the copy and could read the buffer before the NaN arrives). The same cases as on the CPU
    (tests/test_check_finite.py): every rank names the parameter, the check and rank 1."""
    results = ranks(2).run(finite_cases.nan_located, poisoned_rank=1, device="cuda", offload_to="cpu")
    assert_nan_located(results)
