"""Tier 1: unit policies and bucketed collectives, in one process on a fake group of world size 8.

One all-gather per unit in the forward, one reduce-scatter per unit in the backward, ZeRO-3 gathers a
unit again only if the backward reads it, and the bytes a rank sends equal the ZeRO floor plus the
padding, exactly.
"""

import pytest
import thunder
import torch
from fsdp_pass_executors import executors_for
from torch import nn

from fsdp_pass import FSDP, BySize, FSDPError, Groups, fake_process_group
from fsdp_pass.op_names import ALL_GATHER, REDUCE_SCATTER
from fsdp_pass.report.step_stats import floor_bytes, step_stats
from fsdp_pass.text import human_bytes
from tests import llama_steps, models
from tests.llama_steps import LAYERS, WORLD, functional_plan, functional_step, shared_functional_trace
from tests.trace_facts import every_collective_waited_once, gathers, input_numels, reduce_scatters


def _shared(strategy):
    fwd, bwd, fsdp = llama_steps.shared_step(strategy)
    return fwd, bwd, fsdp.unit_plan


@pytest.fixture(scope="module")
def compiled():
    """config -> (forward, backward, UnitPlan): the shared ZeRO-2 and ZeRO-3 steps (tests/llama_steps.py, compiled
    once per session), ZeRO-3 with every unit resharded and with all but the last, made from the shared functional
    trace."""
    return {
        "zero2": _shared("zero2"),
        "zero3": _shared("zero3"),
        "zero3_all": functional_step("zero3", reshard_after_forward=True),
        "zero3_kept": functional_step("zero3", reshard_after_forward=lambda unit: unit.name != "norm+lm_head"),
    }


def padded_bytes(plan, unit) -> int:
    _, shard_numel, _ = plan.unit_numel(unit)
    return shard_numel * WORLD * plan.unit_itemsize(unit)


def test_default_policy_one_unit_per_block_and_the_rest_by_position(compiled):
    _, _, plan = compiled["zero2"]
    names = [u.name for u in plan.units]
    assert names == ["embed", *(f"layers.{i}" for i in range(LAYERS)), "norm+lm_head"]
    embed, *blocks, head = plan.units
    # no unit spans both ends: the embedding is used before the first block, the head after the last
    assert embed.last_use < blocks[0].first_use and head.first_use > blocks[-1].last_use
    assert len(blocks[0].params) == 8  # 2 norms, q, kv, proj, gate, up, down


@pytest.mark.parametrize("config", ["zero2", "zero3", "zero3_all"])
def test_one_gather_per_unit_in_unit_order_and_one_reduce_scatter_per_unit(compiled, config):
    fwd, bwd, plan = compiled[config]
    assert input_numels(gathers(fwd)) == [padded_bytes(plan, u) // 4 // WORLD for u in plan.units]
    assert sorted(input_numels(reduce_scatters(bwd))) == sorted(padded_bytes(plan, u) // 4 for u in plan.units)
    assert every_collective_waited_once(fwd) and every_collective_waited_once(bwd)


def test_collective_counts_follow_the_unit_formula(compiled):
    units = len(compiled["zero2"][2].units)
    counts = {}
    for config, (fwd, bwd, _) in compiled.items():
        s = step_stats(fwd, bwd, WORLD)
        counts[config] = (s.count(ALL_GATHER, "forward"), s.count(ALL_GATHER, "backward"), s.count(REDUCE_SCATTER))
    assert counts["zero2"] == (units, 0, units)
    # ZeRO-3 gathers a unit again only if the backward reads it: never the embedding (its backward needs
    # only the indices); nor a unit kept gathered for the backward (here the last one)
    assert counts["zero3_all"] == (units, units - 1, units)
    assert counts["zero3_kept"] == (units, units - 2, units)
    # by default the last unit as the step model decides it (test_zero3_reshards_the_last_unit_only_where_...)
    from fsdp_pass.cost.candidate_costs import Candidate
    from fsdp_pass.search.last_unit import last_unit, starts_of

    plan = compiled["zero3"][2]  # the default schedule: prefetch 1
    reshards = last_unit(plan.summary, Candidate(starts_of(plan.summary, [u.params for u in plan.units]), ())).reshards
    assert counts["zero3"] == (units, units - 2 + reshards, units)
    assert [u.reshard_after_forward for u in plan.units] == [True] * (units - 1) + [reshards]


def test_bytes_per_step_are_the_floor_plus_padding(compiled):
    _, _, plan = compiled["zero2"]
    param_bytes = sum(plan.unit_numel(u)[0] * 4 for u in plan.units)
    pad_bytes = sum(plan.unit_numel(u)[2] * 4 for u in plan.units)
    assert pad_bytes > 0  # vocab 37 is not a multiple of 8: the test really covers padding
    ring = (WORLD - 1) / WORLD
    zero2 = step_stats(*compiled["zero2"][:2], WORLD)
    assert zero2.bytes_per_rank == pytest.approx(floor_bytes(param_bytes, WORLD, 1) + 2 * ring * pad_bytes)
    zero3 = step_stats(*compiled["zero3_all"][:2], WORLD)
    embed = plan.units[0]
    regathered = sum(padded_bytes(plan, u) for u in plan.units[1:])
    assert zero3.bytes_per_rank == pytest.approx(
        floor_bytes(param_bytes, WORLD, 2) + 3 * ring * pad_bytes - ring * padded_bytes(plan, embed)
    )
    assert zero3.bytes_per_rank == pytest.approx(zero2.bytes_per_rank + ring * regathered)


def test_explicit_non_adjacent_unit_and_the_rest_by_default():
    model = shared_functional_trace()[0]  # unit items are modules of the traced model
    fwd, _, plan = functional_step("zero3", units=[[model.embed, model.norm]])
    names = [u.name for u in plan.units]
    assert names == ["embed+norm", *(f"layers.{i}" for i in range(LAYERS)), "lm_head"]
    assert plan.units[0].params == ("embed.weight", "norm.weight")
    assert plan.units[0].last_use > plan.units[-2].first_use  # spans the program, as asked
    assert len(gathers(fwd)) == len(plan.units)


def test_class_and_glob_items():
    by_class = functional_plan("zero2", units=Groups(models.CausalSelfAttention))
    assert [u.name for u in by_class.units][:3] == ["embed", "layers.0", "layers.0.attn"]  # norm1 runs first
    by_glob = functional_plan("zero2", units=["layers.*.attn"])
    assert [u.name for u in by_glob.units] == [u.name for u in by_class.units]


def test_by_size_merges_consecutive_units_up_to_the_budget():
    plan_blocks = _shared("zero2")[2]
    block_bytes = plan_blocks.unit_numel(plan_blocks.units[1])[0] * 4
    fwd, bwd, plan = functional_step("zero2", units=BySize(2 * block_bytes + 1))
    assert "layers.0..layers.1" in [u.name for u in plan.units] or "embed..layers.0" in [u.name for u in plan.units]
    assert all(plan.unit_numel(u)[0] * 4 <= 2 * block_bytes + 1 or len(u.params) == 1 for u in plan.units)
    assert len(plan.units) < len(plan_blocks.units)
    assert len(gathers(fwd)) == len(plan.units) == len(reduce_scatters(bwd))


class MixedDtypes(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.gain = nn.Parameter(torch.ones(16, dtype=torch.bfloat16))

    def forward(self, x):
        return self.lin(x) * self.gain.float()


def test_a_unit_mixing_dtypes_is_split_and_the_plan_says_so():
    with fake_process_group(WORLD):
        model = MixedDtypes()
        jm = thunder.jit(model, transforms=[FSDP("zero2", units=[["lin", "gain"]])], executors=executors_for("cpu"))
        jm(torch.randn(3, 16, requires_grad=True)).sum().backward()
        plan = jm._lc_transforms[0].unit_plan
        fwd = thunder.last_traces(jm)[-1]
    assert [u.name for u in plan.units] == ["lin+gain[fp32]", "lin+gain[bf16]"]
    assert any("mixes dtypes" in n for n in plan.notes) and "mixes dtypes" in str(plan)
    assert sorted(str(g.output.dtype) for g in gathers(fwd)) == sorted(["thunder.dtypes.float32", "thunder.dtypes.bfloat16"])


@pytest.mark.parametrize(
    "units, message",
    [
        (["no_such_module"], "matches no module or parameter"),
        ([["layers.0"], ["layers.0.attn"]], "is in two units"),
        ("by_block", "Unknown unit policy"),
        ([42], "Cannot read 42 as a unit"),
    ],
)
def test_bad_unit_specs_fail_with_a_clear_message(units, message):
    """Planned on the shared functional trace (the plan stage the transform runs too, without compiling again)."""
    with pytest.raises(FSDPError, match=message):
        functional_plan("zero2", units=units)


def test_a_bad_unit_spec_fails_the_compile_with_a_clear_message():
    """thunder.jit's step raises it too (a small model: only the failure matters here)."""
    with fake_process_group(WORLD), pytest.raises(FSDPError, match="matches no module or parameter"):
        transform = FSDP("zero2", units=["no_such_module"])
        jm = thunder.jit(models.build("mlp"), transforms=[transform], executors=executors_for("cpu"))
        jm(models.batch("mlp", 2, 0)[0])


class _HeadLast(nn.Module):
    """Two layers and a head; the forward returns ``loss``: ``"cross_entropy"`` computed after the head (a Hugging
    Face model fed labels), ``"square"``: the mean of the squared logits (a loss smaller than the head), or
    ``"logits"``, the head's output itself (the caller computes the loss)."""

    def __init__(self, loss: str, d=16, vocab=37):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.head = nn.Linear(d, vocab, bias=False)
        self.loss = loss

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if self.loss == "logits":
            return self.head(x)
        logits = self.head(x).view(-1, self.head.out_features)
        if self.loss == "cross_entropy":
            return nn.functional.cross_entropy(logits, y)
        return logits.square().mean()


@pytest.mark.parametrize("loss, world, rows", [
    ("cross_entropy", 2, 8), ("square", 2, 8), ("cross_entropy", 2, 64),
    ("logits", 2, 8), ("logits", 2, 64), ("logits", 1, 64)])
def test_zero3_reshards_the_last_unit_only_where_the_step_model_predicts_a_lower_peak(loss, world, rows):
    """ZeRO-3's last unit reshards only where the step model predicts a lower step peak for resharding it than for
    keeping it gathered into the backward, by more than its error; a tie keeps it (a gather saved). A loss the
    caller computes on the returned logits (a cross-entropy, as the memory model prices it: two buffers the logits'
    size) or one computed inside the model runs before the head's backward with a kept head beside it: 64 rows of
    37 logits peak there above the head's own backward at 2 ranks (resharded; the traces agree), 8 rows tie
    (kept; the traces tie). At world 1 a gather is the shards themselves (views, no copy: no gather op in the
    trace), so both choices hold the same bytes and the head stays. The plan's note says which, with both
    predictions. Plans only (stages 1-3 on a functional trace)."""
    from fsdp_pass.functional import functional_trace, shard_functional_trace
    from fsdp_pass.search.last_unit import last_unit
    from fsdp_pass.cost.price_plan import candidate_of
    from fsdp_pass.predicates import is_all_gather, is_pack_shards

    torch.manual_seed(0)
    model = _HeadLast(loss)
    prologue, trace = functional_trace(model, torch.randn(rows, 16), torch.randint(0, 37, (rows,)))
    with fake_process_group(world) as group:
        gathered, plan = shard_functional_trace(prologue, trace, group, "zero3", units="blocks", model=model)
    *layers, head = plan.units
    assert [u.name for u in layers] == ["layers.0", "layers.1"] and all(u.reshard_after_forward for u in layers)
    decided = last_unit(plan.summary, candidate_of(plan.summary, plan, plan.options))
    assert head.name == "head" and head.reshard_after_forward is decided.reshards
    assert decided.reshards is (loss != "square" and rows == 64 and world == 2)
    if decided.reshards:  # the traced step peaks: logits 64 rows kept 39872 B, resharded 37440 B; 8 rows tie
        assert decided.resharded_peak < decided.kept_peak
        assert ("caller's loss" if loss == "logits" else "loss's backward") in decided.kept_at
    elif world == 1:  # no gather to keep or free
        assert decided.kept_peak == decided.resharded_peak
        assert not any(is_pack_shards(b) or is_all_gather(b) for b in gathered.bound_symbols)
    (note,) = [n for n in plan.notes if n.startswith("unit 'head'")]
    verdict = "reshards after forward" if decided.reshards else "stays gathered after forward"
    assert verdict in note and "the step model predicts" in note and human_bytes(decided.kept_peak) in note, note
