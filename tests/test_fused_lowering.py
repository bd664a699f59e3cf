"""The schedule and the labels survive a fusion executor: Thunder's torchcompile executor fuses CPU tensors too.

A fusion executor claims every op it can between two it cannot. The ops around each collective (packing,
unpacking, casts, device copies, the division of a reduced shard) are ``fsdp_comm``'s, so they stay out of
the fusion regions: in the final forward every all-gather but the first has compute between its issue and
its wait, in the backward every collective but the first and the last, and every label names its own unit
and bytes. The structure comes from dry runs at world size 2 (the traces rank 0 of 2 gloo ranks runs; no
region is compiled); one real 2-rank gloo run of a small MLP under the same executors trains against one process.
``FSDP(check_finite=True)``'s checks stay top-level ops beside what they read, labelled with their unit, in a dry
run of the tests' MLP under the same executors (its own: the checks would sit between issues and waits, and the
overlap asserted above counts what runs there); a unit's output is checked after its last op, a fusion region.
"""

from __future__ import annotations

import functools

import pytest
import torch
from thunder.core import utils
from thunder.extend import get_executor

from fsdp_pass import MixedPrecision
from fsdp_pass.op_names import ALL_GATHER, REDUCE_SCATTER
from fsdp_pass.ops.finite_checks import OUTPUT, checks_of, flag_owners
from fsdp_pass.predicates import (
    collective_kind,
    is_collective,
    is_finite_check,
    is_return,
    is_unit_op,
    is_wait,
    unit_of_op,
)
from fsdp_pass.report.dry_run import dry_run
from fsdp_pass.report.overlap import overlap_report
from fsdp_pass.text import collective_label
from fsdp_pass_executors import comm_ex
from tests import explain_cases, models, rank_cases, tolerances

FUSED = ("fsdp_comm", "torchcompile", "torch")
WORLD = 2
CONFIGS = {
    "zero3": ("zero3", {"units": "blocks"}),
    "zero2": ("zero2", {"units": "blocks"}),
    "zero3 bf16 offloaded checkpointed": (
        "zero3",
        {"mixed_precision": MixedPrecision(torch.bfloat16), "offload_to": "cpu", "checkpoint_activations": True,
         "units": "blocks"},
    ),
}


@functools.cache
def fused_dry_run(config: str):
    strategy, options = CONFIGS[config]
    executors = [comm_ex if name == "fsdp_comm" else get_executor(name) for name in FUSED]
    return dry_run(*explain_cases.build_model("meta"), WORLD, strategy, executors=executors, **options)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_collectives_overlap_compute_inside_fused_traces(config):
    run = fused_dry_run(config)
    fused = [b for b in run.forward.bound_symbols if b.sym.is_fusion]
    assert fused and all(not is_unit_op(s) for b in fused for s in b.subsymbols)  # regions exist, ours outside
    report = overlap_report(run.forward, run.backward)
    forward = [r for r in report.rows if r.phase == "forward"]
    backward = [r for r in report.rows if r.phase == "backward"]
    assert [r.kind for r in forward] == [ALL_GATHER] * len(run.explanation.plan.units)
    assert [r.exposed for r in forward[1:]] == [False] * (len(forward) - 1), report
    assert len(backward) >= 3 and not any(r.exposed for r in backward[1:-1]), report


def _arg_units(plan):
    """Argument name of each parameter shard -> its unit."""
    unit_of_param = {p: u for u in plan.units for p in u.params}
    return {arg: unit_of_param[p] for arg, p in plan.param_of_arg.items() if p in unit_of_param}


def _unit_of_gather(gather, producers, arg_units):
    """The unit whose shards the buffer an all-gather sends was packed from (read off the shards' names)."""
    shards = producers[gather.flat_proxy_args[0]].args[0]
    (unit,) = {arg_units[s.name] for s in shards}
    return unit


def _unit_of_reduce_scatter(scatter, trace, plan, arg_units):
    """The unit whose shards receive the gradients a reduce-scatter's result is cut into (position ``i`` of the
    backward's return is the gradient of forward argument ``i``)."""
    consumers = utils.consumers(trace)
    (ret,) = [b for b in trace.bound_symbols if is_return(b)]
    (wait,) = [c for c in consumers[scatter.output] if is_wait(c)]
    (unpack,) = [c for c in consumers[wait.output] if is_unit_op(c)]
    position = {g.name: i for i, g in enumerate(ret.args[0]) if g is not None and hasattr(g, "name")}
    args = [plan.arg_order[position[g.name]] for g in unpack.flat_proxy_outs]
    (unit,) = {arg_units[a] for a in args}
    return unit


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_label_names_its_own_unit_and_bytes(config):
    run = fused_dry_run(config)
    plan = run.explanation.plan
    arg_units = _arg_units(plan)
    for trace in (run.forward, run.backward):
        producers = utils.producers(trace)
        labelled = {}
        for b in trace.bound_symbols:
            if not is_collective(b):
                continue
            kind = collective_kind(b)
            unit = (_unit_of_gather(b, producers, arg_units) if kind is ALL_GATHER
                    else _unit_of_reduce_scatter(b, trace, plan, arg_units))
            _, shard_numel, padding = plan.unit_numel(unit)
            itemsize = b.flat_proxy_args[0].dtype.bytes  # the dtype the collective moves
            expected = collective_label(unit.name, kind, len(unit.params), shard_numel * itemsize, WORLD, padding)
            assert b.header == expected, (b.header, expected)
            labelled[b.output.name] = unit.name
            assert unit_of_op(producers[b.flat_proxy_args[0]]) == unit.name  # the packing op's label too
        waits = [b for b in trace.bound_symbols if is_wait(b)]
        assert waits and all(f"[fsdp] wait: unit {labelled[w.args[0].name]!r}" in w.header for w in waits)
        for b in trace.bound_symbols:
            if is_unit_op(b):
                assert str(b.header).startswith(f"[fsdp] unit {unit_of_op(b)!r}: "), b
    backward_kinds = {collective_kind(b) for b in run.backward.bound_symbols}
    assert REDUCE_SCATTER in backward_kinds and (ALL_GATHER in backward_kinds) == (CONFIGS[config][0] == "zero3")


def test_finite_checks_stay_labelled_beside_what_they_read_under_fusion():
    executors = [comm_ex if name == "fsdp_comm" else get_executor(name) for name in FUSED]
    with torch.device("meta"):
        model = models.MODELS["mlp"]()
    run = dry_run(model, (models.batch("mlp", 4, 0)[0],), WORLD, "zero3", executors=executors, check_finite=True,
                 units="blocks")
    key = run.fsdp.compiled_step.key
    checks, owners = checks_of(key), flag_owners(key)
    seen, outputs_of_regions = [], 0
    for trace in (run.forward, run.backward):
        bsyms = trace.bound_symbols
        fused = [s for b in bsyms if b.sym.is_fusion for s in b.subsymbols]
        assert fused and not any(is_finite_check(s) for s in fused)  # regions exist, the checks outside them
        for i, b in enumerate(bsyms):
            if b.sym.name != "check_finite":
                continue
            tensors, _, slot, _ = b.args
            check, before = checks[owners[slot][0]], bsyms[i - 1]
            seen.append(owners[slot][0])
            assert str(b.header).startswith(f"[fsdp] unit {check.unit!r} check finite (flag"), b
            made = {o.name for o in before.flat_proxy_outs}
            if check.what is OUTPUT:  # what the unit's last op (a fusion region) made and a later op reads
                assert {t.name for t in tensors} <= made, b
                outputs_of_regions += before.sym.is_fusion
            else:
                assert [t.name for t in tensors] == [o.name for o in before.flat_proxy_outs]  # read where made
                assert unit_of_op(before) == check.unit
        assert [b.sym.name for b in bsyms if is_return(b) or is_finite_check(b)][-2:] == [
            "raise_if_nonfinite", "python_return"]  # the forward and the backward each decide at their end
    assert seen == list(range(len(checks))) and outputs_of_regions == 3  # each unit's output: a fusion region's


def test_a_fused_step_trains_like_one_process(ranks):
    """2 gloo ranks, ZeRO-3, the torchcompile executor compiling every region: loss and gradients against a
    single process, as the parity tests check the CPU list (torch.compile rounds a little differently). The MLP:
    torch.compile builds every region of the step here (a Llama's take it about twice as long), and the traces of
    the Llama-shaped model under this executor are the dry runs' above."""
    results = ranks(2).run(rank_cases.parity, "mlp", "zero3", steps=3, executor_names=FUSED, measure_step=True)
    r = results[0]
    assert r["loss_rel_err"] < tolerances.FLOAT32 and r["grad_rel_err"] < tolerances.FLOAT32, r  # each parameter's
    assert all(x["local_loss_rel_err"] < tolerances.FLOAT32 for x in results), results  # each rank's, unreduced
    first_gather = next(row[:3] for row in r["schedule"] if row[1] is ALL_GATHER)
    assert [e for e in r["exposed"] if e[0] == "forward"] == [first_gather], r["exposed"]
    # the fused step's peak, measured, is what explain() reads off its fused traces, to the CPU list's precision
    # (measured: 4 B above, the 0-d loss the MLP computes outside the model)
    for x in results:
        assert abs(x["measured_step_peak"] - x["predicted_step_peak"]) <= tolerances.PEAK_BYTES, x
