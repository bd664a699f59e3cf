"""Pass: shard the parameter arguments of a computation trace and gather each unit before first use.

``insert_unshards(trace, plan, arg_params, group) -> trace``

1. Every parameter argument is replaced by a proxy of its shard's shape (same name, so the
   prologue, the gradients and the optimizer all see the sharded tensor).
2. Walking the ops in order, right before the first op that reads a parameter of a unit not yet
   gathered, one ``unshard_unit`` is emitted for the whole unit.
3. Every read of a parameter is redirected to its gathered (full, unpadded) tensor.
4. Units that reshard after forward (ZeRO-3) are tagged ``RECOMPUTE_IN_BACKWARD``: Thunder's
   autodiff then gathers them again in the backward instead of saving them.

Options carried by each ``unshard_unit`` (see :mod:`fsdp_pass.ops.unshard`): the gather and reduce dtypes
of a :class:`~fsdp_pass.plan.mixed_precision.MixedPrecision`, the compute device when the shards are
offloaded, and the gradient-sync mode ``(mode, fsdp_key)`` of :mod:`fsdp_pass.ops.grad_accumulation`.
"""

from __future__ import annotations

from thunder.core.proxies import variableify
from thunder.core.symbol import BoundSymbolTag
from thunder.core.trace import TraceProvenance, from_trace, tracectx

from fsdp_pass.ops.grad_accumulation import REDUCE, accumulator_key
from fsdp_pass.plan.mixed_precision import FULL_PRECISION, MixedPrecision, thunder_dtype
from fsdp_pass.passes.proxies import with_shape
from fsdp_pass.plan.units import UnitPlan
from fsdp_pass.predicates import is_return, is_unpack_trivial
from fsdp_pass.ops.unshard import unshard_unit


def sharded_arg_proxies(trace, plan: UnitPlan, arg_params: dict[str, str]) -> dict:
    """variableified full-shape argument -> proxy of the same name with the shard's shape."""
    swap = {}
    for a in trace.args:
        if getattr(a, "name", None) in arg_params:
            spec = plan.sharding.param(arg_params[a.name])
            swap[variableify(a)] = with_shape(a, spec.layout.shard_shape)
    return swap


def insert_unshards(
    trace,
    plan: UnitPlan,
    arg_params: dict[str, str],
    group,
    *,
    precision: MixedPrecision = FULL_PRECISION,
    compute_device: str | None = None,
    grad_sync: tuple[str, str] = (REDUCE, ""),
):
    mode, fsdp_key = grad_sync
    sharded = sharded_arg_proxies(trace, plan, arg_params)
    param_arg = {param: arg for arg, param in arg_params.items()}
    unit_of_arg = {param_arg[p]: u for u in plan.units for p in u.params}
    sharded_by_name = {v.proxy.name: s for v, s in sharded.items()}

    new = from_trace(trace)
    new.args = tuple(sharded.get(variableify(a), a) for a in trace.args)
    gathered: dict = {}  # variableified full-shape argument -> gathered full tensor
    done: set[str] = set()

    def emit_unshard(unit):
        shards = [sharded_by_name[param_arg[p]] for p in unit.params]
        shapes = tuple(plan.sharding.param(p).layout.shape for p in unit.params)
        new.push_scope([])
        with tracectx(new):
            fulls = unshard_unit(
                shards,
                group,
                unit.name,
                shapes,
                thunder_dtype(precision.param_dtype),
                thunder_dtype(precision.reduce_dtype),
                compute_device,
                None if mode == REDUCE else (mode, accumulator_key(fsdp_key, unit.name)),
            )
        (bsym,) = new.pop_scope()
        if unit.reshard_after_forward:
            bsym.tags.add(BoundSymbolTag.RECOMPUTE_IN_BACKWARD)
        new.bound_symbols.append(bsym)
        for p, full in zip(unit.params, fulls):
            old = next(v for v in sharded if v.proxy.name == param_arg[p])
            gathered[old] = full
        done.add(unit.name)

    for bsym in trace.bound_symbols:
        if is_unpack_trivial(bsym):
            new.bound_symbols.append(bsym.from_bsym_swap_proxies(sharded))
            continue
        if is_return(bsym):
            # outputs read gathered tensors; flat_args name the (sharded) inputs the gradients are for.
            # Swap maps match proxies by name and a shard keeps its parameter's name, so the two are
            # rebuilt separately.
            (ret,) = bsym.from_bsym_swap_proxies(gathered).args
            ret = {**ret, "flat_args": [sharded.get(variableify(a), a) for a in bsym.args[0]["flat_args"]]}
            new.bound_symbols.append(bsym.from_bsym(args=(ret,)))
            continue
        for p in bsym.flat_proxy_args:
            unit = unit_of_arg.get(p.name)
            if unit is not None and unit.name not in done:
                emit_unshard(unit)
        new.bound_symbols.append(bsym.from_bsym_swap_proxies(gathered))

    new.set_provenance(TraceProvenance(f"fsdp_pass: insert unshards ({len(done)} units)"))
    return new
