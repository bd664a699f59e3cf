"""HSDP: a 2-D mesh (replicate x shard) on 4 gloo ranks as 2 x 2, against one process; 1 x 4 and 4 x 1 as the
degenerate cases; clipping and checkpoints that move between a 2-D and a 1-D mesh; bad meshes."""

from __future__ import annotations

import pytest
import thunder
import torch
from torch.distributed.device_mesh import init_device_mesh

from fsdp_pass import FSDP, FSDPError, MixedPrecision, fake_process_group
from fsdp_pass.op_names import ALL_REDUCE, REDUCE_SCATTER
from tests import hsdp_cases, models, rank_cases
from tests.dry_runs import model_dry_run
from tests.test_distributed_checkpoint import _check_resumed_elsewhere, _check_same_world_resume, same_nested

TOL = 1e-5  # relative, float32


def _check_parity(results, tol=TOL, params=True):
    """``params``: also the parameters after the AdamW steps (not for GPT-2: AdamW turns float32 noise in its key
    biases' gradients, zero in exact arithmetic, into full-size updates; see test_distributed_checkpoint)."""
    r = results[0]
    assert r["loss_rel_err"] < tol and r["grad_rel_err"] < tol and r["grad_norm_rel_err"] < tol, r
    assert r["param_rel_err"] < tol or not params, r
    assert r["losses"][-1] < r["losses"][0]
    for rank, x in enumerate(results):
        # each rank's own loss, before any reduction, is the reference's on that rank's slice of the batch
        assert x["local_loss_rel_err"] < tol, (rank, x)
        # each holds exactly its rows of every parameter over its shard group: ceil(rows / shard size) of them
        assert x["shard_numel"] == rank_cases.expected_shard_numel(x["full_shapes"], x["shard_size"]), (rank, x)
        assert x["schedule"] == r["schedule"], (rank, x["schedule"], r["schedule"])
        assert x["replica_diff"] == 0.0, (rank, x)  # the ranks holding the same shard hold the same values


def test_hsdp_zero3_tied_trains_like_one_process(ranks):
    """A tied GPT-2 on 2 x 2: parameters sharded over 2 ranks, each shard held twice; the gradient of every unit
    reduce-scattered in its shard group, then all-reduced over its replicate group, scheduled to overlap."""
    results = ranks(4).run(hsdp_cases.hsdp_parity, "gpt2_tied", "zero3", (2, 2), units="blocks")
    _check_parity(results, params=False)
    r = results[0]
    assert r["shard_size"] == 2  # each rank holds half of every parameter's rows (checked exactly above)
    units = r["unit_names"]
    # gathers and reduce-scatters within the shard group (2 ranks), the all-reduces over the replicas (2)
    assert {(kind, size) for kind, _, size in r["calls"]} == {("all-gather", 2), ("reduce-scatter", 2),
                                                             ("all-reduce", 2)}, r["calls"]
    # per unit one reduce-scatter and one all-reduce of its result (issued once the next unit's is out)
    assert sorted(r["reductions"]) == ["all-reduce"] * len(units) + ["reduce-scatter"] * len(units), r["reductions"]
    assert r["reductions"][:2] == ["reduce-scatter"] * 2, r["reductions"]
    # each all-reduce moves the reduced shard: half of its reduce-scatter's buffer
    by_kind = {k: sorted(n for kind, n, _ in r["calls"] if kind == k) for k in ("reduce-scatter", "all-reduce")}
    assert [2 * n for n in by_kind["all-reduce"]] == by_kind["reduce-scatter"]
    labels = "\n".join(r["labels"])
    for unit in units:
        assert f"unit {unit!r} reduce-scatter grads over the shard group (2 ranks)" in labels, labels
        assert f"unit {unit!r} all-reduce grads over the replicate group (2 ranks)" in labels, labels
    assert len(r["divide_labels"]) == len(units), r["divide_labels"]
    assert all("divide the gradient shard by the 4 ranks (2 per shard group x 2 replicas)" in line
               for line in r["divide_labels"]), r["divide_labels"]
    # overlap: every reduce-scatter but the last unit's, and every all-reduce but the last two units', has
    # compute between its issue and its wait
    exposed = [(kind, unit) for phase, kind, unit in r["exposed"] if phase == "backward"]
    reduce_scatters = [row for row in r["schedule"] if row[0] == "backward" and row[1] == "reduce-scatter"]
    last = max(reduce_scatters, key=lambda row: row[3])[2]  # nothing is left to overlap with its collectives
    assert all(unit == last for kind, unit in exposed if kind == "reduce-scatter"), exposed
    assert len([1 for kind, _ in exposed if kind == "all-reduce"]) <= 2, exposed


def test_hsdp_zero2_mixed_precision(ranks):
    """The users' recipe under HSDP: a Llama-style model (GQA, rotary tables cast from float32 buffers, RMSNorm),
    bf16 gathers and compute, float32 reduce-scatter and all-reduce, ZeRO-2, on 2 x 2. One decoder layer holds
    every one of those ops (a second made the test ~27 % more CPU time)."""
    precision = MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    results = ranks(4).run(
        hsdp_cases.hsdp_parity, "llama_gqa", "zero2", (2, 2), compute_dtype=torch.bfloat16, mixed_precision=precision,
        model_config={"n_layer": 1},
    )
    _check_parity(results, tol=1e-5)
    r = results[0]
    assert r["full_precision_grad_norm_rel_err"] > max(r["grad_norm_rel_err"], 1e-3), r  # the casts are real


def test_hsdp_no_sync_accumulates_without_any_collective(ranks):
    results = ranks(4).run(hsdp_cases.hsdp_accumulation, "mlp", "zero3", (2, 2))
    r = results[0]
    assert r["grad_rel_err"] < TOL, r
    units = r["units_with_grads"]
    assert r["reduce_scatters_per_micro_batch"] == [0, 0, units, 0, 0, units], r
    assert r["left_pending"] == 0 and r["accumulated_bytes"] == [r["predicted_accumulator_bytes"]] * 2, r


@pytest.mark.parametrize(("shape", "shard_size", "all_reduces"), [((1, 4), 4, False), ((4, 1), 1, True)])
def test_degenerate_meshes(ranks, shape, shard_size, all_reduces):
    """1 x 4 is FSDP over 4 ranks (no all-reduce); 4 x 1 shards over one rank and all-reduces over four (DDP)."""
    results = ranks(4).run(hsdp_cases.hsdp_parity, "mlp", "zero3", shape)
    _check_parity(results)
    r = results[0]
    assert r["shard_size"] == shard_size
    assert any(kind == "all-reduce" for kind, _, _ in r["calls"]) == all_reduces, r["calls"]


def test_hsdp_clipping_counts_each_gradient_once(ranks):
    """The global norm over 2 x 2 ranks: each replica holds the same reduced shards, so the norm sums the shard
    group only; clipped gradients and parameters as torch's clip_grad_norm_ in one process."""
    results = ranks(4).run(hsdp_cases.hsdp_clip, "mlp", "zero3", (2, 2))
    r = results[0]
    assert max(r["total_rel_err"]) <= 1e-6 and max(r["param_norm_rel_err"]) <= 1e-6, r
    assert max(r["clipped_grad_rel_err"]) <= 1e-5 and r["param_rel_err"] <= 1e-5, r
    assert r["coefs"][0] < 0.5, r
    assert all(x["totals"] == r["totals"] for x in results)


def test_hsdp_checkpoint_saved_once_and_resumed_on_a_1d_mesh_and_back(ranks, tmp_path):
    """Saved on 2 x 2: each row range of each tensor is in the checkpoint once (not once per replica); resumed
    bitwise there, loaded by FSDP over the 4 ranks (1-D), trained on, saved, and loaded back on 2 x 2."""
    hsdp_dir, flat_dir = str(tmp_path / "hsdp"), str(tmp_path / "flat")
    saved = ranks(4).run(hsdp_cases.hsdp_save_and_continue, (2, 2), "odd_shapes", "zero2", "sgd", hsdp_dir)
    _check_same_world_resume(saved, plain=["temperature"])
    chunks = saved[0]["chunks"]
    rows = {"a.weight": 5, "b.weight": 3}  # split over the shard group of 2: ceil(rows / 2) and the rest
    for name, n in rows.items():  # the parameter, and its momentum in the optimizer's state
        for key in (f"model.{name}", f"optim.state.{name}.momentum_buffer"):
            assert chunks[key] == [(0, (n + 1) // 2), ((n + 1) // 2, n // 2)], chunks
    flat = ranks(4).run(hsdp_cases.hsdp_resume_and_save, None, "odd_shapes", "zero2", "sgd", hsdp_dir, flat_dir)
    _check_resumed_elsewhere(saved[0], flat)
    back = ranks(4).run(hsdp_cases.hsdp_resume_and_save, (2, 2), "odd_shapes", "zero2", "sgd", flat_dir,
                        str(tmp_path / "again"))
    assert same_nested(back[0]["state_at_load"], flat[0]["state_at_save"])


def test_bad_meshes_fail_with_what_to_do():
    with fake_process_group(8):
        cube = init_device_mesh("cpu", (2, 2, 2))
        swapped = init_device_mesh("cpu", (2, 4), mesh_dim_names=("shard", "replicate"))
        cases = [
            (FSDP("zero3", mesh=cube), "has 3 dimensions"),
            (FSDP("zero3", mesh=swapped), "the shard dim comes first"),
            (FSDP("zero3", mesh=swapped, process_group=swapped.get_group(0)), "both process_group= and mesh="),
            (FSDP("zero3", mesh="2x4"), "is not a torch DeviceMesh"),
        ]
        for fsdp, message in cases:
            with pytest.raises(FSDPError, match=message):
                thunder.jit(models.build("mlp"), transforms=[fsdp])


def test_hsdp_dry_run_is_fsdp_over_the_shard_group_plus_the_all_reduces():
    """One process, a fake group of 4 as 2 x 2, against FSDP over 2 ranks (test_explain's dry run): the same
    shards, step peak (the all-reduce sums the reduced shard in place) and shard-group bytes, plus one
    all-reduce per reduce-scatter that sends, over 2 replicas, 2(R-1)/R of the shard: the reduce-scatter's
    buffer / 2."""
    hsdp = model_dry_run(4, "zero3", mesh=(2, 2)).explanation
    flat = model_dry_run(2, "zero3").explanation
    assert hsdp.memory.sharded_params == flat.memory.sharded_params
    assert hsdp.memory.step.peak_bytes == flat.memory.step.peak_bytes
    reduce_scatters = [c for c in hsdp.stats.collectives if c.kind is REDUCE_SCATTER]
    all_reduces = [c for c in hsdp.stats.collectives if c.kind is ALL_REDUCE]
    assert len(all_reduces) == len(reduce_scatters) > 0
    assert {c.group_size for c in all_reduces} == {2} and {c.group_size for c in reduce_scatters} == {2}
    assert hsdp.stats.replicate_bytes_per_rank == sum(c.full_bytes for c in reduce_scatters) / 2
    assert hsdp.stats.bytes_per_rank - hsdp.stats.replicate_bytes_per_rank == flat.stats.bytes_per_rank
    text = str(hsdp)
    assert "HSDP: 2 replicas x a shard group of 2 ranks" in text and "over the replicate group (2 ranks" in text


def test_the_step_model_prices_the_all_reduce_across_replicas():
    """The same two dry runs, priced by the auto planner's step model: the same shard group, plus one all-reduce
    of each reduced shard across the 2 replicas, on their own link."""
    from fsdp_pass.cost.cost_model import DEFAULTS
    from fsdp_pass.cost.candidate_costs import OPS_PER_COLLECTIVE

    hsdp, flat = model_dry_run(4, "zero3", mesh=(2, 2)), model_dry_run(2, "zero3")
    assert hsdp.explanation.plan.summary.replicas == 2 and flat.explanation.plan.summary.replicas == 1
    cost = DEFAULTS["h100-nvlink"]
    priced, flat_priced = hsdp.predict_step(cost), flat.predict_step(cost)
    assert priced.peak_bytes == flat_priced.peak_bytes
    # the host issues and waits for one more collective per unit (its copies are too small to outlast that)
    units = len(hsdp.explanation.plan.units)
    assert priced.compute_s - flat_priced.compute_s == pytest.approx(units * OPS_PER_COLLECTIVE * cost.op_s)
    assert priced.step_s > flat_priced.step_s
