"""The step-by-step path the notebooks use: one process, fake group, any world size."""

import re
from dataclasses import replace

import pytest
import thunder
import torch
from torch import nn
from torch.nn import functional as F
from fsdp_pass_executors import executors_for

from torch.distributed.device_mesh import init_device_mesh

from fsdp_pass import FSDP, fake_process_group
from fsdp_pass.functional import derive_backward_and_lower, functional_trace, shard_functional_trace
from fsdp_pass.pipeline import reschedule
from fsdp_pass.cost.cost_model import DEFAULTS, LinkCost
from fsdp_pass.plan.schedule import DEFAULT_SCHEDULE
from tests import models
from tests.trace_facts import every_collective_waited_once, gathers, input_numels, reduce_scatters


@pytest.mark.parametrize("world_size", [3, 64])
def test_functional_steps_shard_gather_and_reduce(world_size):
    x, _ = models.batch("mlp", 3, 0)
    model = models.MLP()
    prologue, trace = functional_trace(model, x)
    with fake_process_group(world_size) as group:
        sharded, plan = shard_functional_trace(prologue, trace, group, "zero3", model=model)
        forward, backward = derive_backward_and_lower(sharded, plan)
    rows = {"fc1.weight": (32, 16), "fc1.bias": (32, 1), "fc2.weight": (16, 32), "fc2.bias": (16, 1),
            "head.weight": (4, 16), "head.bias": (4, 1)}
    shard = {n: -(-r // world_size) * c for n, (r, c) in rows.items()}
    # no repeated blocks: one unit per top-level child, each gathered with one collective
    unit_shard = {m: shard[f"{m}.weight"] + shard[f"{m}.bias"] for m in ("fc1", "fc2", "head")}
    assert [u.name for u in plan.units] == list(unit_shard)
    assert [u.params for u in plan.units] == [(f"{m}.weight", f"{m}.bias") for m in unit_shard]
    assert input_numels(gathers(forward)) == list(unit_shard.values())
    assert sorted(input_numels(reduce_scatters(backward))) == sorted(world_size * s for s in unit_shard.values())
    # zero3: the head stays gathered (the backward starts with it); fc2 is gathered again; fc1 is not
    # needed by the backward (it only multiplies the input)
    assert [u.reshard_after_forward for u in plan.units] == [True, True, False]
    assert input_numels(gathers(backward)) == [unit_shard["fc2"]]
    assert every_collective_waited_once(forward) and every_collective_waited_once(backward)
    # the sharded arguments carry the shard shapes
    args = {a.name: tuple(a.shape) for a in sharded.args}
    assert args["t_fc1_weight"] == (-(-32 // world_size), 16)


def _saved_for_backward(forward) -> int:
    (_, (saved, _)) = forward.bound_symbols[-1].args  # return (outputs, (saved tensors, saved other))
    return len(saved)


def test_functional_forward_saves_what_thunder_jit_saves():
    # lowering with `del`s before the split would save every intermediate (and the gathered buffers) instead
    x, _ = models.batch("mlp", 2, 0)
    prologue, trace = functional_trace(models.MLP(), x)
    with fake_process_group(4) as group:
        sharded, plan = shard_functional_trace(prologue, trace, group, "zero3", model=models.MLP(), units="blocks")
        forward, _ = derive_backward_and_lower(sharded, plan)
        jm = thunder.jit(models.MLP(), transforms=[FSDP("zero3", units="blocks")], executors=executors_for("cpu"))
        jm(x).sum().backward()
    assert _saved_for_backward(forward) == _saved_for_backward(thunder.last_traces(jm)[-1])


def _canonical(trace) -> str:
    """The printed trace with proxy numbers (t12, ft13) and context-object numbers (ProcessGroup_2) replaced by
    their order of first appearance: two compiles number their proxies from different counters; long lines joined
    (where Thunder wraps them depends on the numbers' lengths)."""
    seen: dict[str, str] = {}
    text = re.sub(r" *\\\n\s*", " ", str(trace))
    text = re.sub(r"\b(f?t)\d+\b", lambda m: seen.setdefault(m.group(0), f"{m.group(1)}#{len(seen)}"), text)
    return re.sub(r"\b(_[A-Za-z][A-Za-z0-9_]*?)_\d+\b", r"\1", text)


@pytest.mark.parametrize(
    "strategy, options",
    [("zero3", {"units": "blocks"}),
     ("zero2", {"mixed_precision": torch.bfloat16, "checkpoint_activations": True, "units": "blocks"})],
    ids=["zero3", "zero2-bf16-checkpointed"],
)
def test_the_functional_path_writes_the_traces_the_transform_writes(strategy, options):
    """Both run fsdp_pass.pipeline: the same stages in the same order, so the same final traces."""
    x, _ = models.batch("mlp", 2, 0)
    prologue, trace = functional_trace(models.MLP(), x, mixed_precision=options.get("mixed_precision"))
    with fake_process_group(4) as group:
        sharded, plan = shard_functional_trace(prologue, trace, group, strategy, model=models.MLP(), **options)
        forward, backward = derive_backward_and_lower(sharded, plan)
        jm = thunder.jit(models.MLP(), transforms=[FSDP(strategy, **options)], executors=executors_for("cpu"))
        jm(x).sum().backward()
    assert "[fsdp] unit 'fc1' all-gather" in str(forward)  # labelled, scheduled, checked: the whole pipeline
    assert _canonical(forward) == _canonical(thunder.last_traces(jm)[-1])
    assert _canonical(backward) == _canonical(thunder.last_backward_traces(jm)[-1])
    assert [u.name for u in plan.units] == [u.name for u in jm._lc_transforms[0].unit_plan.units]


class _MLPLanguageModel(nn.Module):
    """A Llama without attention, quick to trace: embedding, one block (norm, MLP), norm, head."""

    def __init__(self, vocab=37, d=16, hidden=24):
        super().__init__()
        self.embed, self.norm, self.lm_head = nn.Embedding(vocab, d), nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.layers = nn.ModuleList([nn.Sequential(nn.LayerNorm(d), nn.Linear(d, hidden), nn.SiLU(), nn.Linear(hidden, d))])

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = x + layer(x)
        return self.lm_head(self.norm(x))


# a GPU whose gathers take long against this model's compute (no latency, 10 MB/s, 1 GFLOP/s): within a budget of a
# few of its units' bytes, the auto plan gives units prefetch depths other than the default's one
_SLOW_LINK = replace(DEFAULTS["h100-nvlink"], link=LinkCost(0.0, 1e7), flops_per_s=1e9, op_s=0.0)


def test_the_functional_path_schedules_with_the_auto_plans_prefetch_depths_as_fsdp_does():
    """FSDP("auto") schedules its step with the plan's prefetch depths (options_of_auto_plan); so does the
    functional path, with the options shard_functional_trace made the plan with: the same final traces."""
    x, _ = models.batch("llama_gqa", 2, 0)
    auto = dict(cost=_SLOW_LINK, memory_budget="28KiB")
    prologue, trace = functional_trace(_MLPLanguageModel(), x)
    with fake_process_group(4) as group:
        sharded, plan = shard_functional_trace(prologue, trace, group, "auto", model=_MLPLanguageModel(), **auto)
        forward, backward = derive_backward_and_lower(sharded, plan)
        fsdp = FSDP("auto", **auto)
        jm = thunder.jit(_MLPLanguageModel(), transforms=[fsdp], executors=executors_for("cpu"))
        jm(x).sum().backward()
    schedule = plan.options.schedule
    assert schedule == replace(DEFAULT_SCHEDULE, prefetch=plan.auto.candidate.prefetch,
                               prefetch_by_unit=plan.auto.prefetch_by_unit)
    assert schedule != DEFAULT_SCHEDULE, "this budget no longer makes the auto plan prefetch other than the default"
    assert [u.name for u in plan.units] == [u.name for u in fsdp.unit_plan.units]
    assert _canonical(forward) == _canonical(thunder.last_traces(jm)[-1])
    assert _canonical(backward) == _canonical(thunder.last_backward_traces(jm)[-1])
    # the plan's depths change the step: the default schedule writes other traces
    default = reschedule(fsdp.compiled_step, DEFAULT_SCHEDULE)
    assert (_canonical(default.forward), _canonical(default.backward)) != (_canonical(forward), _canonical(backward))


def test_the_functional_path_takes_a_2d_mesh_as_fsdp_does():
    """HSDP from one functional trace: a ("replicate", "shard") mesh in place of the group gives the traces
    FSDP(mesh=...) writes, with each reduce-scatter's shard all-reduced over the replicate group."""
    x, _ = models.batch("mlp", 2, 0)
    prologue, trace = functional_trace(models.MLP(), x)
    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        sharded, plan = shard_functional_trace(prologue, trace, mesh, "zero3", model=models.MLP(), units="blocks")
        forward, backward = derive_backward_and_lower(sharded, plan)
        jm = thunder.jit(models.MLP(), transforms=[FSDP("zero3", mesh=mesh, units="blocks")],
                         executors=executors_for("cpu"))
        jm(x).sum().backward()
    assert plan.sharding.world_size == 2 and plan.summary.replicas == 2
    assert "all-reduce grads over the replicate group (2 ranks)" in str(backward)
    assert _canonical(forward) == _canonical(thunder.last_traces(jm)[-1])
    assert _canonical(backward) == _canonical(thunder.last_backward_traces(jm)[-1])


def test_a_partly_frozen_unit_is_gathered_whole_and_reduces_its_trainable_parameters_only():
    """Unit fc1+head of the frozen MLP: fc1 frozen, head trainable. Its gathers move all four parameters;
    its reduce-scatter's label counts the head's two and their bytes, the size of the buffer it reduces."""
    x, _ = models.batch("frozen", 2, 0)
    model = models.build("frozen")
    prologue, trace = functional_trace(model, x)
    with fake_process_group(4) as group:
        sharded, plan = shard_functional_trace(prologue, trace, group, "zero3", model=model,
                                               units=models.NON_ADJACENT_UNITS["frozen"])
        forward, backward = derive_backward_and_lower(sharded, plan)
    (scatter,) = [b for b in reduce_scatters(backward) if "fc1+head" in str(b.header)]
    head = 4 * 16 + 4  # head.weight [4, 16] and head.bias [4]: one row of each per rank at 4 ranks
    assert scatter.flat_proxy_args[0].numel == head
    per_rank = head // 4 * 4  # 17 float32 elements a rank
    assert f"reduce-scatter grads: 2 param(s), {per_rank} B/rank x 4" in scatter.header, scatter.header
    assert "all-gather: 4 param(s)" in next(b.header for b in gathers(forward) if "fc1+head" in str(b.header))


class _Attention(nn.Module):
    """One causal attention of 4 heads between two projections: the smallest step with an attention."""

    def __init__(self, d=16):
        super().__init__()
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (4, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))


def test_the_functional_path_summarizes_the_step_for_the_executors_it_lowers_with():
    """The plan's step summary reads which attentions the executors run as one kernel: on the CPU, cpu_attention's
    flash kernel keeps no b·h·s·s scores for the backward. shard_functional_trace made it for no executor (every
    attention op by op) while derive_backward_and_lower lowers with the CPU's, as FSDP does: notebook 05's
    Llama-2-7B slice (2 layers, 2048 tokens, 8 ranks, ZeRO-3) was priced 5.9 GiB against its traced 4.6 (4.5 with
    the kernel known)."""
    model, x = _Attention(), torch.randn(2, 8, 16)
    prologue, trace = functional_trace(model, x)
    scores = {}
    with fake_process_group(4) as group:
        for name, executors in (("default", None), ("cpu", executors_for("cpu")), ("torch", [thunder.pytorch_executor])):
            _, plan = shard_functional_trace(prologue, trace, group, "zero3", model=model, executors=executors)
            scores[name] = sum(p.scores_bytes for p in plan.summary.pieces)
    assert scores == {"default": 0, "cpu": 0, "torch": scores["torch"]} and scores["torch"] > 0
