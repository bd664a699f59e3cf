"""Activation checkpointing per unit (``FSDP(checkpoint_activations=...)``): less saved, no extra collective.

Tier 1 reads dry-run traces (meta device, fake group of 8); tier 2 trains on gloo ranks against a
single-process reference.
"""

import pytest

from fsdp_pass import FSDPError, explain
from fsdp_pass.report.dry_run import dry_run
from fsdp_pass.predicates import is_all_gather
from fsdp_pass.report.step_stats import step_stats
from fsdp_pass.op_names import ALL_GATHER
from tests import explain_cases, rank_cases
from tests.dry_runs import model_dry_run
from tests.test_parity import ONE_BLOCK, _check

WORLD = 8


def _linears(trace) -> int:
    return sum(1 for b in trace.bound_symbols if str(b.sym.name) in ("linear", "matmul"))


@pytest.fixture(scope="module", params=["zero2", "zero3"])
def plain_and_checkpointed(request):
    runs = [
        model_dry_run(WORLD, request.param, **({"checkpoint_activations": True} if ck else {})) for ck in (False, True)
    ]
    return request.param, runs


def test_checkpointing_adds_no_collective(plain_and_checkpointed):
    _, (plain, ckpt) = plain_and_checkpointed
    stats = [step_stats(r.forward, r.backward, WORLD) for r in (plain, ckpt)]
    assert [(c.phase, c.kind, c.full_bytes) for c in stats[0].collectives] == [
        (c.phase, c.kind, c.full_bytes) for c in stats[1].collectives
    ]
    # at most one gather per unit in the backward: the recomputation reads the gather the gradients need
    assert all(len(u.backward_gathers) <= 1 for u in ckpt.explanation.units)
    assert sum(1 for b in ckpt.backward.bound_symbols if is_all_gather(b)) == stats[0].count(ALL_GATHER, "backward")


def test_checkpointing_recomputes_instead_of_saving(plain_and_checkpointed):
    _, (plain, ckpt) = plain_and_checkpointed
    p, c = plain.explanation.memory.step, ckpt.explanation.memory.step
    assert c.saved_bytes < 0.6 * p.saved_bytes, (c.saved_bytes, p.saved_bytes)
    assert c.peak_bytes < p.peak_bytes
    assert _linears(ckpt.backward) > _linears(plain.backward)  # the layers' matmuls run again
    assert _linears(ckpt.forward) == _linears(plain.forward)
    assert all(u.checkpointed for u in ckpt.explanation.units)
    assert not any(u.checkpointed for u in plain.explanation.units)


def test_checkpoint_only_the_layers():
    run = dry_run(
        *explain_cases.build_model("meta"), WORLD, "zero3", checkpoint_activations=lambda u: ".layers." in u.name
    )
    assert [u.checkpointed for u in run.explanation.units] == [False, True, True, False]
    assert "ckpt" in str(explain(run.explanation.plan))


def test_bad_checkpoint_spec():
    with pytest.raises(FSDPError, match="checkpoint_activations"):
        dry_run(*explain_cases.build_model("meta"), WORLD, "zero3", checkpoint_activations="layers")


@pytest.mark.parametrize(("model_name", "strategy"), [("gpt2_tied", "zero2"), ("llama_gqa", "zero3")])
def test_parity_with_checkpointing(ranks, model_name, strategy):
    # one block: a unit's recomputation is the same whichever block it is (tests/test_parity.py ONE_BLOCK)
    results = ranks(2).run(
        rank_cases.parity, model_name, strategy, checkpoint_activations=True, model_config=ONE_BLOCK
    )
    _check(results, 2)
