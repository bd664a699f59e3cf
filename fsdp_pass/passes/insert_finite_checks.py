"""Pass: ``FSDP(check_finite=True)``'s NaN/inf checks in a final trace (the ops: :mod:`fsdp_pass.ops.finite_checks`).

``insert_finite_checks(trace, phase, plan, group, key, scope) -> trace`` runs on the final forward and backward
traces, after the schedule (stage 6 of :mod:`fsdp_pass.pipeline`). Each check goes right after the op whose results
it reads, so no later pass moves it away from them, and the fusion executor, which ran before, cannot take it into a
region: the checks read only tensors that the final trace holds at top level, under every executor list. Every check
of a unit's buffer has one flag per parameter, so the error names the parameter whatever the units.

1. Forward, per unit: after its ``pack_shards``, a check of the packed shard, one flag per parameter's segment (its
   parameters as this rank sends them: the gathered parameters are every rank's packed shard side by side, so each
   rank checking its own covers them all and says which rank's shard holds the NaN). An 8-bit gather has no packed
   shard: after its ``quantize_shard``, a check of the shards it quantized, one flag each. An offloaded unit's packed
   shard is the host-to-device copy's output: the check reads it after the copy (on the copy's stream, on CUDA).
   ZeRO-3's second gather, in the backward, is not checked again. A unit whose gather is its shards themselves (one
   rank: :func:`~fsdp_pass.plan.gather_rules.gathers_nothing`) has its ``view_shards`` in place of the pack: its
   parameters, views of the shards, are checked right after it, one flag each.
2. Forward, per region: a region is a block (a repeated module, one unit per block under ``units="blocks"``; the
   parameters outside the blocks: their unit), or a unit where the unit is finer than its block. It starts at the
   first op that reads one of its gathered parameters and ends where the next region starts: the ops in between
   that read no parameter (a residual add, the next block's norm statistics) are its own. After its last op, one
   check of its output: what its ops computed that an op after it reads (the next region, or the trace's outputs),
   the output as the next region sees it. A region read again later (a tied embedding as the head) is checked
   after each stretch.
3. Backward, per unit: after ``pack_grads``, this rank's gradient before the reduce-scatter, one flag per
   parameter's columns of the rank-major buffer; after ``unpack_grad_shard``, the reduced gradient shards, one flag
   each.
4. ``clear_finite_flags`` first in the forward (after the inputs are named); ``raise_if_nonfinite`` right before the
   return of the forward (its checks) and of the backward (its checks).

The checks are numbered in the order they run; each op's header names its unit, its flags and what it reads.
"""

from __future__ import annotations

from thunder.core.proxies import TensorProxy
from thunder.core.pytree import tree_flatten
from thunder.core.trace import TraceProvenance, from_trace

from fsdp_pass.ops.finite_checks import (
    COLUMNS,
    DESCRIPTION,
    EACH,
    GRADIENT,
    GRADIENT_SHARD,
    OUTPUT,
    PARAMETERS,
    SEGMENTS,
    FiniteCheck,
    add_checks,
    bound_check,
    bound_clear,
    bound_decision,
)
from fsdp_pass.ops.flat_buffers import layouts_of, pack_copies_to_device
from fsdp_pass.plan.units import UnitPlan
from fsdp_pass.predicates import (
    is_bookkeeping,
    is_collective,
    is_conversion,
    is_del,
    is_finite_check,
    is_input_unpacking,
    is_pack_grads,
    is_pack_shards,
    is_quantize_shard,
    is_return,
    is_unit_op,
    is_unpack_gathered,
    is_unpack_grad_shard,
    is_view_like,
    is_view_shards,
    is_wait,
    unit_of_op,
)


def _tensors(bsym) -> list:
    return [p for p in bsym.flat_proxy_outs if isinstance(p, TensorProxy)]


def _shard_names(plan: UnitPlan, shards) -> tuple[str, ...]:
    """The parameters whose shards a pack or view op reads (the shards keep their arguments' names)."""
    names = tuple(plan.param_of_arg.get(s.name) for s in shards)
    return () if None in names else names


def _trainable(plan: UnitPlan, unit: str, shapes, sharded: bool) -> tuple[str, ...]:
    """The parameters whose gradients a unit's pack (``shapes``: full) or unpack op (``sharded``: the shards')
    holds: its parameters that need one, in order; ``()`` where they do not match ``shapes`` (one flag for all)."""
    names = tuple(n for n in plan.unit_named[unit].params if plan.sharding.param(n).requires_grad)
    layouts = [plan.sharding.param(n).layout for n in names]
    mine = tuple(tuple(lay.shard_shape if sharded else lay.shape) for lay in layouts)
    return names if mine == tuple(tuple(s) for s in shapes) else ()


def _buffer_checks(bsyms, phase: str, plan: UnitPlan) -> list[tuple[int, FiniteCheck, list, object]]:
    """Steps 1 and 3: ``(index of the op the check follows, check, tensors, cut)`` of ``phase``'s unit buffers."""
    found = []
    for i, b in enumerate(bsyms):
        unit = unit_of_op(b) if is_unit_op(b) else None
        if unit not in plan.unit_named:
            continue
        if phase == "forward" and is_pack_shards(b):
            names = _shard_names(plan, b.args[0])
            cut = (SEGMENTS, tuple(int(s.numel) for s in b.args[0])) if names else None
            found.append((i, FiniteCheck(unit, PARAMETERS, phase, names), _tensors(b), cut))
        elif phase == "forward" and is_view_shards(b):
            names = _shard_names(plan, b.args[0])
            found.append((i, FiniteCheck(unit, PARAMETERS, phase, names), _tensors(b), (EACH,) if names else None))
        elif phase == "forward" and is_quantize_shard(b):  # the shards it read, one flag each (its output is codes)
            names = _shard_names(plan, b.args[0])
            found.append((i, FiniteCheck(unit, PARAMETERS, phase, names), list(b.args[0]), (EACH,) if names else None))
        elif phase == "backward" and is_pack_grads(b):
            _, _, full_shapes, world, _, _ = b.args
            names = _trainable(plan, unit, full_shapes, sharded=False)
            sizes = tuple(lay.shard_numel for lay in layouts_of(full_shapes, world))
            found.append((i, FiniteCheck(unit, GRADIENT, phase, names), _tensors(b),
                          (COLUMNS, world, sizes) if names else None))
        elif phase == "backward" and is_unpack_grad_shard(b):
            names = _trainable(plan, unit, b.args[2], sharded=True)
            found.append((i, FiniteCheck(unit, GRADIENT_SHARD, phase, names), _tensors(b), (EACH,) if names else None))
    return found


def _regions_of_parameters(plan: UnitPlan) -> dict[str, tuple[str, str]]:
    """Parameter name -> (its region, its unit): its block (the step summary's pieces name each parameter's Blocks
    unit) where its unit holds more than that block, else its unit."""
    unit_of = {p: u.name for u in plan.units for p in u.params}
    block_of = {p: piece.block for piece in getattr(plan.summary, "pieces", ()) for p in piece.params}
    blocks_in = {u.name: {block_of.get(p, u.name) for p in u.params} for u in plan.units}
    return {p: (block_of[p] if p in block_of and len(blocks_in[u]) > 1 else u, u) for p, u in unit_of.items()}


def _gathered_regions(bsyms, plan: UnitPlan) -> dict[str, tuple[str, str]]:
    """Name of each gathered parameter in the forward (the outputs of ``unpack_gathered`` and ``view_shards``) ->
    (its region, its unit)."""
    region_of, out = _regions_of_parameters(plan), {}
    for b in bsyms:
        if is_view_shards(b):
            names = [plan.param_of_arg.get(s.name) for s in b.args[0]]
        elif is_unpack_gathered(b) and unit_of_op(b) in plan.unit_named:
            names = plan.unit_named[unit_of_op(b)].params
        else:
            continue
        out.update((o.name, region_of[n]) for o, n in zip(_tensors(b), names) if n in region_of)
    return out


def _is_compute(b) -> bool:
    """An op of the model's computation (a copy under another name, ``shallow_copy``, included): not the pass's
    buffer ops, collectives or checks, nor the naming of inputs, ``del`` or the return."""
    return not (is_input_unpacking(b) or is_del(b) or is_return(b) or is_unit_op(b) or is_collective(b)
                or is_wait(b) or is_finite_check(b))


def _stretches(bsyms, gathered: dict) -> tuple[list[list], set[str]]:
    """Step 2's stretches of ops, ``[first, last, (region, unit)]`` in trace order, and the names of the gathered
    parameters and their views and casts."""
    names, runs = dict(gathered), []
    for i, b in enumerate(bsyms):
        if not _is_compute(b):
            continue
        read = [names[p.name] for p in b.flat_proxy_args if p.name in names]
        if read and (is_view_like(b) or is_conversion(b) or is_bookkeeping(b)):  # a view, cast, copy of a parameter
            names.update((o.name, read[0]) for o in _tensors(b))
            continue
        current = runs[-1][2] if runs else None
        new = [r for r in read if r != current]
        if new:
            runs.append([i, i, new[-1]])
        elif runs:
            runs[-1][1] = i
    return runs, set(names)


def _output_checks(bsyms, plan: UnitPlan) -> list[tuple[int, FiniteCheck, list, object]]:
    """Step 2: ``(index of a stretch's last op, check, its output, None)`` per stretch."""
    runs, parameters = _stretches(bsyms, _gathered_regions(bsyms, plan))
    last_read: dict[str, int] = {}  # name -> the last op of the model's computation that reads it
    for i, b in enumerate(bsyms):
        if _is_compute(b):
            last_read.update((p.name, i) for p in b.flat_proxy_args)
    ret = next((b for b in reversed(bsyms) if is_return(b)), None)
    if ret is not None:  # the trace's outputs are read after every op (what it saves for a backward is not)
        last_read.update((p.name, len(bsyms)) for p in tree_flatten(ret.args[0])[0] if isinstance(p, TensorProxy))
    found = []
    for first, last, (region, unit) in runs:
        made = [o for b in bsyms[first : last + 1] if _is_compute(b) for o in _tensors(b) if o.name not in parameters]
        tensors = [t for t in made if last_read.get(t.name, -1) > last]
        if tensors:
            found.append((last, FiniteCheck(unit, OUTPUT, "forward", region=region), tensors, None))
    return found


def _check_header(check: FiniteCheck, slot: int, after) -> str:
    """The check's label: its unit, its flags, what it reads; for an offloaded shard (``after``, the op it follows,
    copies it to a device) that it reads the copy, on the stream that makes it."""
    flags = f"flag {slot}" if check.flags == 1 else f"flags {slot}..{slot + check.flags - 1}, one per parameter"
    what = DESCRIPTION[check.what]
    if check.what == OUTPUT and check.region != check.unit:
        what = f"the output of {check.region!r} (what its ops computed and the ops after it read, after its last op)"
    moved = pack_copies_to_device(after) if is_pack_shards(after) else None
    if moved is not None:
        what += f", read after its copy to {moved} (on CUDA on the stream that copies it, before the all-gather there)"
    return f"[fsdp] unit {check.unit!r} check finite ({flags}): {what}"


def insert_finite_checks(trace, phase: str, plan: UnitPlan, group, key: str, scope: str = ""):
    """``group``: every rank of the model (they decide together); ``key``: the compile's key (its flags);
    ``scope``: the model's (a loss scaler on it takes over the backward's verdict)."""
    bsyms = trace.bound_symbols
    planned = _buffer_checks(bsyms, phase, plan) + (_output_checks(bsyms, plan) if phase == "forward" else [])
    planned.sort(key=lambda f: f[0])  # stable: two checks after one op keep their order
    firsts = add_checks(key, group, [check for _, check, _, _ in planned], scope)
    after: dict[int, list] = {}
    for (at, check, tensors, cut), slot in zip(planned, firsts):
        after.setdefault(at, []).append(bound_check(tensors, key, slot, cut, _check_header(check, slot, bsyms[at])))

    start = next((i for i, b in enumerate(bsyms) if not is_input_unpacking(b)), len(bsyms))
    new = from_trace(trace)
    for i, b in enumerate(bsyms):
        if phase == "forward" and i == start:
            new.bound_symbols.append(bound_clear(key, f"[fsdp] check finite: clear this step's flags ({key})"))
        if is_return(b):
            new.bound_symbols.append(bound_decision(key, phase, (
                f"[fsdp] check finite: this rank's flags of the {phase} of {key} to the host, one all-reduce over "
                "every rank; if any is set, every rank raises an FSDPError naming the first parameter or output, "
                "what it checked and the rank")))
        new.bound_symbols.append(b)
        new.bound_symbols.extend(after.get(i, ()))
    new.set_provenance(TraceProvenance(f"fsdp_pass: check finite ({len(planned)} checks in the {phase})"))
    return new
