"""``FSDP(check_finite=True)``: the NaN/inf locator.

Tier 1 (dry runs at world 2, one process, the tests' MLP with ``units="blocks"``): off, the traces hold no check op;
on, they are the same traces with, per unit, a labelled check of its packed shard right after its pack (one flag per
parameter), of each unit's output after its last op (the residual add included), of its gradient after its pack and
of its gradient shard after its unpack (one flag per parameter each), the flags cleared first in the forward and a
verdict last in the forward and last in the backward, numbered in execution order. A unit holding the whole model
still has a flag per parameter and an output check per block; an offloaded unit's check reads the copy to the device,
on the stream that copies it. The fused lowering's labels: tests/test_fused_lowering.py. Tier 2 (2 gloo ranks): a
NaN or an inf planted on rank 1 only (an input, a parameter shard, a loss, a residual add's overflow, a forward with
no backward), and both ranks raise the same NonFiniteError naming the parameter (or the output), the check and rank
1; two finite gradients whose sum overflows a bfloat16 reduce-scatter, which only the check after it sees; the 2-layer
HF Llama as one unit; float16 with a GradScaler, whose overflow the checks leave to it.
"""

from __future__ import annotations

import contextlib
import functools
import math

import pytest
import torch

from fsdp_pass import FSDP, FSDPError
from fsdp_pass.ops import finite_checks
from fsdp_pass.ops.finite_checks import (
    COLUMNS,
    EACH,
    GRADIENT,
    GRADIENT_SHARD,
    OUTPUT,
    PARAMETERS,
    SEGMENTS,
    FiniteCheck,
    NonFiniteError,
    add_checks,
    checks_of,
    flag_owners,
)
from fsdp_pass.ops.flat_buffers import WRITTEN_ON
from fsdp_pass.predicates import (
    is_finite_check,
    is_pack_grads,
    is_pack_shards,
    is_return,
    is_unpack_grad_shard,
    is_view_shards,
    unit_of_op,
)
from fsdp_pass.report.dry_run import dry_run
from tests import finite_cases, models

UNITS = ["fc1", "fc2", "head"]  # the MLP's, in forward order
# the last op of each unit's ops in the MLP's forward, head(x + fc2(gelu(fc1(x)))): gelu's last multiply, the
# residual add, the head's linear
LAST_OP_OF = {"fc1": "mul", "fc2": "add", "head": "linear"}
FIRST_TRAINABLE = "model.embed_tokens.weight"  # the HF Llama's first parameter in its one unit's buffer


@functools.cache
def mlp_dry_run(check_finite: bool, world: int = 2):
    with torch.device("meta"):
        model = models.MODELS["mlp"]()
    return dry_run(model, (models.batch("mlp", 4, 0)[0],), world, "zero3", units="blocks", check_finite=check_finite)


def _ops(trace, keep=lambda b: True) -> list:
    return [b.sym.id for b in trace.bound_symbols if keep(b)]


def _checks(trace) -> list[tuple[int, object, object]]:
    """(position, the check, the op right before it) for every check_finite in ``trace``."""
    bsyms = trace.bound_symbols
    return [(i, b, bsyms[i - 1]) for i, b in enumerate(bsyms) if is_finite_check(b) and b.sym.name == "check_finite"]


def test_off_no_op_on_every_unit_checked_in_execution_order():
    off, on = mlp_dry_run(False), mlp_dry_run(True)
    for phase in ("forward", "backward"):
        off_trace, on_trace = getattr(off, phase), getattr(on, phase)
        assert not any(is_finite_check(b) for b in off_trace.bound_symbols)  # off: zero cost
        assert _ops(on_trace, lambda b: not is_finite_check(b)) == _ops(off_trace)  # on: nothing else changes
    key = on.fsdp.compiled_step.key
    checks = checks_of(key)
    assert [(c.unit, c.what, c.phase) for c in checks] == [
        ("fc1", PARAMETERS, "forward"), ("fc2", PARAMETERS, "forward"), ("fc1", OUTPUT, "forward"),
        ("head", PARAMETERS, "forward"), ("fc2", OUTPUT, "forward"), ("head", OUTPUT, "forward"),
        ("head", GRADIENT, "backward"), ("fc2", GRADIENT, "backward"), ("fc1", GRADIENT, "backward"),
        ("head", GRADIENT_SHARD, "backward"), ("fc2", GRADIENT_SHARD, "backward"), ("fc1", GRADIENT_SHARD, "backward"),
    ]  # the order the ops run in: fc2's shard is packed (prefetched) before fc1 computes
    for c in checks:  # one flag per parameter of a unit's buffer; one per output
        assert c.parts == (() if c.what == OUTPUT else (f"{c.unit}.weight", f"{c.unit}.bias")), c
    owners = flag_owners(key)
    slots = []
    for phase in ("forward", "backward"):
        trace = getattr(on, phase)
        for _, b, before in _checks(trace):
            tensors, b_key, slot, cut = b.args
            check_index, part = owners[slot]
            check = checks[check_index]
            assert part == 0  # a check's first flag
            slots.extend(range(slot, slot + check.flags))
            assert b_key == key and b.header.startswith(f"[fsdp] unit {check.unit!r} check finite (flag"), b
            reader = {PARAMETERS: is_pack_shards, GRADIENT: is_pack_grads, GRADIENT_SHARD: is_unpack_grad_shard}
            assert "read after its copy" not in str(b.header), b  # nothing offloaded: read where it is made
            if check.what in reader:
                assert reader[check.what](before) and unit_of_op(before) == check.unit, before
                assert [t.name for t in tensors] == [o.name for o in before.flat_proxy_outs], b  # what it made
                assert cut[0] == {PARAMETERS: SEGMENTS, GRADIENT: COLUMNS, GRADIENT_SHARD: EACH}[check.what], cut
            else:  # the output: after the last op of the unit's ops, what an op after it reads
                assert cut is None and before.sym.name == LAST_OP_OF[check.unit], before
                assert [t.name for t in tensors] == [before.output.name], b
        names = [b.sym.name for b in trace.bound_symbols if is_finite_check(b)]
        ret = next(i for i, b in enumerate(trace.bound_symbols) if is_return(b))
        if phase == "forward":  # cleared before any check
            assert names[0] == "clear_finite_flags"
        decision = trace.bound_symbols[ret - 1]  # each phase decides its own checks at its end
        assert decision.sym.name == "raise_if_nonfinite" and decision.args == (key, phase), decision
        assert "[fsdp] check finite" in str(decision.header)
    assert slots == list(range(len(owners)))


def test_the_output_is_checked_after_the_residual_add():
    """fc2's output, as head reads it, is ``x + fc2(...)``: its check follows that add (the last op before head's
    first read of its parameters), not fc2's linear, so an overflow in the add is blamed on fc2 (the rank test
    'residual' below)."""
    forward = mlp_dry_run(True).forward
    checks = checks_of(mlp_dry_run(True).fsdp.compiled_step.key)
    owners = flag_owners(mlp_dry_run(True).fsdp.compiled_step.key)
    (add,) = [(b, before) for _, b, before in _checks(forward) if checks[owners[b.args[2]][0]].unit == "fc2"
              and checks[owners[b.args[2]][0]].what == OUTPUT]
    check, before = add
    linear = next(b for b in forward.bound_symbols if b.sym.name == "linear" and b.output.name in
                  {p.name for p in before.flat_proxy_args})
    assert before.sym.name == "add" and "x" in {p.name for p in before.flat_proxy_args}  # x + fc2(gelu(fc1(x)))
    assert linear.output.name != check.args[0][0].name


def test_one_rank_checks_each_units_shards_and_output_without_a_gather():
    """At world 1 a unit's gather is its shards themselves (no pack, collective or copy): its one ``view_shards``
    op, labelled with the unit, views them as the parameters; they are checked right after it, one flag each, the
    unit's output after its last op."""
    on = mlp_dry_run(True, 1)
    forward = on.forward
    assert not any(is_pack_shards(b) for b in forward.bound_symbols)
    checks, owners = checks_of(on.fsdp.compiled_step.key), flag_owners(on.fsdp.compiled_step.key)
    assert [(c.unit, c.what) for c in checks if c.phase == "forward"] == [
        (u, w) for u in UNITS for w in (PARAMETERS, OUTPUT)]  # no prefetch over one rank: each unit in turn
    shard_args = {a for a, p in on.fsdp.unit_plan.arguments if p is not None}
    for _, b, before in _checks(forward):
        tensors, _, slot, cut = b.args
        check = checks[owners[slot][0]]
        if check.what == PARAMETERS:  # the unit's parameters, viewed from its shards by the op before
            assert is_view_shards(before) and before.args[1] == check.unit, before
            assert f"[fsdp] unit {check.unit!r}: one rank:" in str(before), before
            assert [t.name for t in tensors] == [o.name for o in before.flat_proxy_outs], b
            assert {s.name for s in before.args[0]} <= shard_args, before
            assert cut == (EACH,) and check.parts == (f"{check.unit}.weight", f"{check.unit}.bias")
        else:
            assert before.sym.name == LAST_OP_OF[check.unit], before


def test_a_buffer_another_stream_fills_is_checked_on_that_stream_and_the_verdict_waits_for_it(monkeypatch):
    """An offloaded unit's packed shard is the host-to-device copy's output, which the executor runs on the
    communication stream and names on the buffer (``WRITTEN_ON``): the check runs on that stream (after the copy,
    before the all-gather issued there next), and the step's verdict waits for it. Without CUDA the stream is a
    stand-in and ``_on_stream`` records what it is entered with; tests/test_cuda.py runs it on a GPU."""
    key, copy_stream, entered = "stream-test", object(), []
    add_checks(key, None, [FiniteCheck("u", PARAMETERS, "forward", ("u.a", "u.b"))])
    monkeypatch.setattr(finite_checks, "_on_stream", lambda s: contextlib.nullcontext(entered.append(s)))
    flat = torch.tensor([1.0, 2.0, 3.0, math.nan])  # u.a: 3 elements, u.b: 1
    setattr(flat, WRITTEN_ON, copy_stream)
    finite_checks.clear_finite_flags_impl(key)
    finite_checks.check_finite_impl([flat], key, 0, (SEGMENTS, (3, 1)))
    assert entered == [copy_stream] and finite_checks._STEPS[key].streams == {copy_stream}
    with pytest.raises(NonFiniteError, match="first \\(in execution order\\) in parameter 'u.b'") as e:
        finite_checks.raise_if_nonfinite_impl(key, "forward")
    assert e.value.parameter == "u.b" and e.value.check.what == PARAMETERS


def test_on_the_cpu_a_buffer_is_read_whole_and_cut_into_its_parameters_only_when_not_finite(monkeypatch):
    """The CPU's check costs one ``aminmax`` of a clean unit buffer, as one flag per unit did; a buffer that is not
    finite is then read per parameter, and the flag of the one holding the inf is set."""
    key, reads = "host-test", []
    add_checks(key, None, [FiniteCheck("u", GRADIENT, "backward", ("u.a", "u.b", "u.c"))])
    read = finite_checks._finite_on_host
    monkeypatch.setattr(finite_checks, "_finite_on_host", lambda ts: reads.append(len(ts)) or read(ts))
    flat = torch.zeros(2, 6)  # 2 ranks' rows; u.a 3 columns, u.b 2, u.c 1
    finite_checks.clear_finite_flags_impl(key)
    finite_checks.check_finite_impl([flat.view(-1)], key, 0, (COLUMNS, 2, (3, 2, 1)))
    assert reads == [1] and finite_checks._STEPS[key].values.tolist() == [0, 0, 0]
    flat[1, 4] = math.inf  # rank 1's part of u.b
    finite_checks.check_finite_impl([flat.view(-1)], key, 0, (COLUMNS, 2, (3, 2, 1)))
    assert reads == [1, 1, 1, 1, 1] and finite_checks._STEPS[key].values.tolist() == [0, 1, 0]


def test_offloaded_units_check_the_copy_to_the_device():
    """Offloaded, a unit's pack op copies its shards to the compute device: the check reads that copy, right
    after the op that makes it (no other reader of the shards comes between)."""
    with torch.device("meta"):
        model = models.MODELS["mlp"]()
    run = dry_run(model, (models.batch("mlp", 4, 0)[0],), 2, "zero3", units="blocks", check_finite=True,
                  offload_to="cpu")
    checks, owners = checks_of(run.fsdp.compiled_step.key), flag_owners(run.fsdp.compiled_step.key)
    packs = 0
    for _, b, before in _checks(run.forward):
        if checks[owners[b.args[2]][0]].what == PARAMETERS:
            assert is_pack_shards(before) and before.args[3] is not None, before  # copied to the compute device
            assert [t.name for t in b.args[0]] == [before.output.name]
            assert ", read after its copy to meta (on CUDA on the stream that copies it" in str(b.header), b
            packs += 1
    assert packs == len(UNITS)


def test_nan_on_one_rank_every_rank_names_parameter_check_and_rank(ranks):
    assert_nan_located(ranks(2).run(finite_cases.nan_located, poisoned_rank=1))


def assert_nan_located(results: list[dict]) -> None:
    """What ``finite_cases.nan_located`` must find on every rank (poisoned rank 1); tests/test_cuda.py's too."""
    for r in results:
        assert r["clean_loss"] == r["plain_loss"], r  # the checks change no number
        assert all(r[k] == "ok" for k in ("clean_after_input", "clean_at_end")), r  # flags cleared at every step
        expected = {
            "input": ("unit 'fc1', its output", "forward", None),
            "forward_only": ("unit 'fc1', its output", "forward", None),  # gradients on, no backward
            "parameter": ("parameter 'fc2.bias' (module 'fc2', unit 'fc2'): this rank's shard", "forward", "fc2.bias"),
            "gradient": ("parameter 'head.weight' (module 'head', unit 'head'): its gradient on this rank, before the "
                         "reduce-scatter", "backward", "head.weight"),
            "no_grad": ("unit 'fc1', its output", "forward", None),  # a step without a backward decides at its end
            "residual": ("unit 'fc2', its output", "forward", None),  # the add after fc2's linear, not head's
        }
        for case, (where, phase, parameter) in expected.items():
            found = r[case]
            assert isinstance(found, dict), (case, found)
            message = found["message"]
            assert f"first (in execution order) in {where}" in message and f"{phase}, on rank 1." in message, message
            assert "What to do" in message and len(message) < 800, message
            assert (found["parameter"], found["rank"], found["phase"]) == (parameter, 1, phase), found
    assert all(r[case] == results[0][case] for r in results for case in ("input", "parameter", "gradient", "no_grad"))


def test_a_unit_holding_the_whole_hf_llama_names_the_parameter_and_the_layer(ranks):
    """The 2-layer HF Llama as one unit: its packed shard and its gradients still have one flag per parameter, in
    the buffer's order, and each block (the embedding, each decoder layer, the final norm with the head) its own
    output check. A NaN in rank 1's shard of ``model.layers.1.mlp.down_proj.weight``: every rank names that
    parameter, its module, rank 1, the forward and the parameter check (before: the whole model's unit). Layer 1's
    MLP overflowing names layer 1's output (before: the unit's); an infinite loss names a parameter's gradient in
    the backward."""
    results = ranks(2).run(finite_cases.hf_llama_located, poisoned_rank=1)
    for r in results:
        assert r["clean"] == "ok" and r["clean_at_end"] == "ok" and len(r["units"]) == 1, r
        ((unit, params),) = r["units"]
        # the unit's buffers: one flag per parameter, in the buffer's order; one output check per block
        by_what = {w: [c for c in r["checks"] if c[1] == w] for w in (PARAMETERS, OUTPUT, GRADIENT, GRADIENT_SHARD)}
        trainable = tuple(n for n in params if n in r["trainable"])
        assert [c[2] for c in by_what[PARAMETERS]] == [tuple(params)] and len(params) == 21
        assert [c[2] for c in by_what[GRADIENT] + by_what[GRADIENT_SHARD]] == [trainable, trainable]
        assert [(c[0], c[3]) for c in by_what[OUTPUT]] == [(unit, region) for region in (
            "model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm+lm_head")]
        p = r["parameter"]
        assert (p["parameter"], p["rank"], p["phase"], p["what"]) == (
            "model.layers.1.mlp.down_proj.weight", 1, "forward", PARAMETERS), p
        assert ("parameter 'model.layers.1.mlp.down_proj.weight' (module 'model.layers.1.mlp.down_proj', unit "
                f"{unit!r}): this rank's shard, as its all-gather sends it, in the forward, on rank 1.") in p["message"]
        out = r["layer_output"]
        assert (out["what"], out["region"], out["parameter"], out["phase"]) == (OUTPUT, "model.layers.1", None,
                                                                               "forward"), out
        assert f"in the output of 'model.layers.1' (in unit {unit!r}), in the forward, on rank 0." in out["message"]
        g = r["gradient"]
        assert (g["what"], g["rank"], g["phase"], g["parameter"]) == (GRADIENT, 1, "backward", FIRST_TRAINABLE), g
    assert results[0] == results[1]


def test_a_grad_scaler_skips_the_overflow_and_the_forward_checks_still_raise(ranks):
    """float16, ``GradScaler(init_scale=2**24)``: the first step's gradients overflow; the scaler skips it and
    backs off (before, the gradient check raised in the backward and the run died there). A NaN in a parameter
    shard still raises, in the forward."""
    for r in ranks(2).run(finite_cases.scaler_overflow, poisoned_rank=1):
        assert r["first"] == "ok" and r["first_stepped"] == [False] and r["scale_after_first"] == 2.0**23, r
        p = r["parameter"]
        assert (p["parameter"], p["rank"], p["phase"]) == ("fc2.bias", 1, "forward"), p


def test_a_sum_that_overflows_the_reduce_dtype_is_found_after_the_reduce_scatter(ranks):
    """Every rank's gradient finite (0.6x bfloat16's largest value at most), their sum in a bfloat16 reduce-scatter
    not: the check after the reduce-scatter is the first to fire, on every rank, naming the parameter whose
    gradient shard overflowed and the lowest rank holding it, and says what to do (reduce in float32)."""
    results = ranks(2).run(finite_cases.sum_overflows_the_reduce)
    for r in results:
        assert r["largest_rank_grad"] <= 0.61 * r["largest"], r  # every rank's gradient finite, with room
        found = r["raised"]
        assert isinstance(found, dict), found
        assert (found["what"], found["phase"]) == (GRADIENT_SHARD, "backward"), found
        assert (found["parameter"], found["rank"]) == r["expected"], (found, r["expected"])
        parameter, rank = r["expected"]
        assert (f"first (in execution order) in parameter {parameter!r} (module {parameter.rpartition('.')[0]!r}, "
                f"unit {parameter.split('.')[0]!r}): its gradient shard, after the reduce-scatter, in the backward, "
                f"on rank {rank}.") in found["message"], found["message"]
        assert "the sum overflows the reduce dtype" in found["message"], found["message"]
    assert results[0]["raised"] == results[1]["raised"]


def test_check_finite_takes_a_bool():
    assert FSDP().options.check_finite is False and FSDP(check_finite=True).options.check_finite is True
    with pytest.raises(FSDPError, match="check_finite=1 is not a bool"):
        FSDP(check_finite=1)
