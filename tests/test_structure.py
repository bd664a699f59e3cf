"""Tier 1: one process, fake process group at world size 8: count and order of collectives.

These tests pin the per-parameter policy (one collective per parameter) with every unit resharded
after forward, so each parameter's gather can be followed on its own; units are tested in test_units.
"""

import pytest
import thunder

from fsdp_pass import FSDP, fake_process_group
from fsdp_pass_executors import executors_for
from tests import models
from tests.trace_facts import (
    every_collective_waited_once,
    gathers,
    input_numels,
    reduce_scatters,
    saved_for_backward_names,
    saved_for_backward_shapes,
    waits,
)

WORLD = 8
# MLP parameters in order of first use, and each one's numel per rank at world size 8
MLP_ORDER = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "head.weight", "head.bias"]
MLP_SHARD_NUMEL = [4 * 16, 4, 2 * 32, 2, 1 * 16, 1]


def compile_mlp(strategy):
    with fake_process_group(WORLD):
        jm = thunder.jit(models.MLP(), transforms=[FSDP(strategy, units="per_parameter", reshard_after_forward=strategy == "zero3")], executors=executors_for("cpu"))
        x, y = models.batch("mlp", 3, 0)  # batch 3: no activation shares a weight's shape
        models.loss_fn("mlp", jm(x), y).backward()
        fsdp = jm._lc_transforms[0]
        return thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1], fsdp.unit_plan


@pytest.fixture(scope="module")
def traces():
    return {s: compile_mlp(s) for s in ("zero2", "zero3")}


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_forward_gathers_each_parameter_once_in_first_use_order(traces, strategy):
    fwd, _, plan = traces[strategy]
    assert [u.name for u in plan.units] == MLP_ORDER
    assert input_numels(gathers(fwd)) == MLP_SHARD_NUMEL
    assert reduce_scatters(fwd) == []
    assert every_collective_waited_once(fwd)


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_backward_reduce_scatters_every_gradient_once(traces, strategy):
    _, bwd, _ = traces[strategy]
    # reduce-scatter input is the padded full gradient: N x the shard
    assert sorted(input_numels(reduce_scatters(bwd))) == sorted(n * WORLD for n in MLP_SHARD_NUMEL)
    assert every_collective_waited_once(bwd)
    assert len(waits(bwd)) == len(reduce_scatters(bwd)) + len(gathers(bwd))


def test_zero2_backward_has_no_gather_and_reuses_saved_parameters(traces):
    fwd, bwd, _ = traces["zero2"]
    assert gathers(bwd) == []
    shapes = saved_for_backward_shapes(fwd)
    assert (16, 32) in shapes and (4, 16) in shapes  # full fc2.weight and head.weight kept


def test_zero3_backward_gathers_again_what_it_needs(traces):
    fwd, bwd, plan = traces["zero3"]
    assert all(u.reshard_after_forward for u in plan.units)
    # the backward needs the weights that multiply a gradient: head.weight, then fc2.weight
    # (fc1.weight only multiplies the input, which needs no gradient; biases are never needed)
    assert input_numels(gathers(bwd)) == [1 * 16, 2 * 32]
    shapes = saved_for_backward_shapes(fwd)
    assert (16, 32) not in shapes and (4, 16) not in shapes  # no full parameter saved
    assert {"t_fc2_weight", "t_head_weight"} <= set(saved_for_backward_names(fwd))  # their shards are


def test_plan_prints_as_table(traces):
    _, _, plan = traces["zero3"]
    text = str(plan)
    assert "strategy=zero3 world_size=8 units=6" in text
    for name in MLP_ORDER:
        assert name in text


def test_tied_embedding_is_one_shard_gathered_at_each_use():
    with fake_process_group(WORLD):
        jm = thunder.jit(models.TinyGPT2(), transforms=[FSDP("zero3", units="blocks")], executors=executors_for("cpu"))
        x, y = models.batch("gpt2_tied", 2, 0)
        models.loss_fn("gpt2_tied", jm(x), y).backward()
        fsdp = jm._lc_transforms[0]
        names = [n for n, _ in jm.named_parameters()]
        assert "wte.weight" in names and "lm_head.weight" not in names  # one sharded tensor
        assert jm.get_parameter("lm_head.weight") is jm.get_parameter("wte.weight")
        units = fsdp.unit_plan.units
        # gathered where each name is used: with the embeddings first, with the final norm last
        assert units[0].name == "wte+wpe" and "wte.weight" in units[0].params
        assert units[-1].name == "ln_f+lm_head" and "lm_head.weight" in units[-1].params
        fwd = thunder.last_traces(jm)[-1]
        assert len(gathers(fwd)) == len(units)


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_every_collective_and_wait_is_labelled_with_its_unit(traces, strategy):
    fwd, bwd, _ = traces[strategy]
    for trace in (fwd, bwd):
        for bsym in gathers(trace) + reduce_scatters(trace) + waits(trace):
            assert "[fsdp]" in str(bsym.header) and "unit '" in str(bsym.header), bsym
    text = str(bwd)
    for name in MLP_ORDER:
        assert f"[fsdp] unit '{name}' reduce-scatter grads" in text
    if strategy == "zero3":
        assert "[fsdp] unit 'head.weight' all-gather" in text
