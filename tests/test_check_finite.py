"""``FSDP(check_finite=True)``: the NaN/inf locator (issue 38 item 4).

Tier 1 (dry runs of the tests' MLP at world 2, one process): off, the traces hold no check op; on, they are the same
traces with, per unit, a labelled check of its packed shard right after its pack, of its output right after the last
op that reads its parameters, of its gradient after its pack and of its gradient shard after its unpack, the flags
cleared first in the forward and the verdict last in the backward, numbered in execution order. The fused lowering's
labels: tests/test_fused_lowering.py. Tier 2 (2 gloo ranks): a NaN or an inf planted on rank 1 only (an input, a
parameter shard, a loss), and both ranks raise the same FSDPError naming the first unit, what was not finite and rank 1.
"""

from __future__ import annotations

import functools

import pytest
import torch

from fsdp_pass import FSDP, FSDPError
from fsdp_pass.ops.finite_checks import GRADIENT, GRADIENT_SHARD, OUTPUT, PARAMETERS, checks_of
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
    slots = []
    for phase in ("forward", "backward"):
        trace = getattr(on, phase)
        for _, b, before in _checks(trace):
            tensors, b_key, slot = b.args
            check = checks[slot]
            slots.append(slot)
            assert b_key == key and b.header.startswith(f"[fsdp] unit {check.unit!r} check finite (flag {slot}): ")
            assert [t.name for t in tensors] == [o.name for o in before.flat_proxy_outs], b  # what the op before made
            reader = {PARAMETERS: is_pack_shards, GRADIENT: is_pack_grads, GRADIENT_SHARD: is_unpack_grad_shard}
            if check.what in reader:
                assert reader[check.what](before) and unit_of_op(before) == check.unit, before
            else:  # the output: the op that last reads the unit's parameters (a linear, here)
                assert before.sym.name == "linear", before
        names = [b.sym.name for b in trace.bound_symbols if is_finite_check(b)]
        ret = next(i for i, b in enumerate(trace.bound_symbols) if is_return(b))
        if phase == "forward":  # cleared before any check; a forward with a backward does not decide
            assert names[0] == "clear_finite_flags" and "raise_if_nonfinite" not in names
        else:
            assert trace.bound_symbols[ret - 1].sym.name == "raise_if_nonfinite" and "[fsdp] check finite" in str(
                trace.bound_symbols[ret - 1].header)
    assert slots == list(range(len(checks)))


def test_one_rank_checks_each_units_shards_and_output_without_a_gather():
    """At world 1 a unit's gather is its shards themselves (no pack, collective or copy): its one ``view_shards``
    op, labelled with the unit, views them as the parameters; they are checked right after it, the unit's output
    after the last op that reads them."""
    on = mlp_dry_run(True, 1)
    forward = on.forward
    assert not any(is_pack_shards(b) for b in forward.bound_symbols)
    checks = checks_of(on.fsdp.compiled_step.key)
    assert [(c.unit, c.what) for c in checks if c.phase == "forward"] == [
        (u, w) for u in UNITS for w in (PARAMETERS, OUTPUT)]  # no prefetch over one rank: each unit in turn
    shard_args = {a for a, p in on.fsdp.unit_plan.arguments if p is not None}
    for _, b, before in _checks(forward):
        tensors, _, slot = b.args
        if checks[slot].what == PARAMETERS:  # the unit's parameters, viewed from its shards by the op before
            assert is_view_shards(before) and before.args[1] == checks[slot].unit, before
            assert f"[fsdp] unit {checks[slot].unit!r}: one rank:" in str(before), before
            assert [t.name for t in tensors] == [o.name for o in before.flat_proxy_outs], b
            assert {s.name for s in before.args[0]} <= shard_args, before
        else:
            assert before.sym.name == "linear", before


def test_nan_on_one_rank_every_rank_names_unit_what_and_rank(ranks):
    results = ranks(2).run(finite_cases.nan_located, poisoned_rank=1)
    for r in results:
        assert r["clean_loss"] == r["plain_loss"], r  # the checks change no number
        assert all(r[k] == "ok" for k in ("clean_after_input", "clean_at_end")), r  # flags cleared at every step
        expected = {
            "input": ("unit 'fc1', its output", "in the forward"),
            "parameter": ("unit 'fc2', its parameters (this rank's shard", "in the forward"),
            "gradient": ("unit 'head', its gradient (this rank's, before the reduce-scatter)", "in the backward"),
            "no_grad": ("unit 'fc1', its output", "in the forward"),  # a step without a backward decides at its end
        }
        for case, (where, phase) in expected.items():
            message = r[case]
            assert f"first (in execution order) in {where}" in message and f"{phase}, on rank 1." in message, message
            assert "What to do" in message and len(message) < 700, message
    assert all(r[case] == results[0][case] for r in results for case in ("input", "parameter", "gradient", "no_grad"))


def test_check_finite_takes_a_bool():
    assert FSDP().options.check_finite is False and FSDP(check_finite=True).options.check_finite is True
    with pytest.raises(FSDPError, match="check_finite=1 is not a bool"):
        FSDP(check_finite=1)
