"""Gradient accumulation without reduce-scatters (``fsdp_pass.no_sync``), on gloo ranks against one big batch.

Per cycle, 3 micro-batches per rank: two under ``no_sync`` (no reduce-scatter, unsharded gradients added to
per-unit accumulators), the last outside it (one reduce-scatter per unit of the sum). Each mode is its own
compiled variant, picked by a prologue check.
"""

import pytest
import thunder
import torch
from fsdp_pass_executors import executors_for

from fsdp_pass import FSDP, FSDPError, explain, fake_process_group, no_sync
from fsdp_pass.text import human_bytes
from tests import models, rank_cases

TOL = 1e-5  # float32


def test_accumulation_matches_one_big_batch(ranks):
    """Odd shapes: padding rows and a 0-d parameter in the accumulators, at the cost of a small model's three
    compiles (accumulate, flush, plain); the README loop (tests/test_distributed_checkpoint.py) accumulates a
    transformer's gradients."""
    results = ranks(2).run(rank_cases.accumulation_parity, "odd_shapes", "zero3")
    r = results[0]
    assert r["grad_rel_err"] < TOL, r
    # no collective while accumulating; one reduce-scatter per unit on the last micro-batch of each cycle
    units = r["units_with_grads"]
    assert r["reduce_scatters_per_micro_batch"] == [0, 0, units, 0, 0, units], r
    # the accumulators hold what explain() predicts, and are empty after the flush
    assert r["accumulated_bytes"] == [r["predicted_accumulator_bytes"]] * 2, r
    assert r["left_pending"] == 0
    assert r["compiles"] == 3  # accumulate, flush, and the plain step at the end: each compiled once
    assert all(x["reduce_scatters_per_micro_batch"] == r["reduce_scatters_per_micro_batch"] for x in results)


def test_the_comm_executor_is_put_first_when_the_list_lacks_it():
    """The accumulation ops (and the collectives, and their pack and unpack ops) run on fsdp_comm only:
    FSDP puts it first in a list that lacks it, so no_sync works with any executor list."""
    with fake_process_group(2):
        jm = thunder.jit(models.build("mlp"), transforms=[FSDP("zero2")], executors=[thunder.extend.get_executor("torch")])
        names = [e.name for e in thunder.compile_data(jm).executors_list]
        assert names[0] == "fsdp_comm" and "torch" in names
        x, _ = models.batch("mlp", 2, 0)
        with no_sync(jm):
            jm(x).sum().backward()
        assert "fsdp_accumulate_unsharded_grads(" in str(thunder.last_backward_traces(jm)[-1])
        # compiled under no_sync: explain() says what the accumulators hold without being asked
        e = explain(jm)
        assert e.no_sync and f"no_sync accumulators {human_bytes(e.memory.accumulator_bytes)}" in str(e)


def test_no_sync_on_a_model_without_fsdp():
    with pytest.raises(FSDPError, match="not compiled with fsdp_pass.FSDP"), no_sync(thunder.jit(torch.nn.Linear(2, 2))):
        pass


def test_an_optimizer_step_while_gradients_accumulate_is_refused():
    """Stepping with gradients still in the accumulators would skip them now and add them to the next step."""
    with fake_process_group(2):
        jm = thunder.jit(models.build("mlp"), transforms=[FSDP("zero2")], executors=executors_for("cpu"))
        opt = torch.optim.SGD(jm.parameters(), lr=0.1)
        unrelated = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        x, y = models.batch("mlp", 2, 0)
        with no_sync(jm):
            opt.step()  # nothing accumulated yet
            models.loss_fn("mlp", jm(x), y).backward()
            assert all(p.grad is None for p in jm.parameters())
            with pytest.raises(FSDPError, match="still hold gradients accumulated under no_sync"):
                opt.step()
            unrelated.step()  # other parameters: not this model's business
        with pytest.raises(FSDPError, match="outside no_sync"):
            opt.step()  # after the block, but before the synchronized backward
        models.loss_fn("mlp", jm(x), y).backward()  # adds the accumulated sum and reduce-scatters it
        assert all(p.grad is not None for p in jm.parameters())
        opt.step()
