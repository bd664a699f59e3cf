"""Pass: shard the parameter arguments of a computation trace and gather each unit before first use.

``insert_unshards(trace, plan, group, precision=..., compute_device=..., grad_sync=...) -> trace``

1. Every parameter argument is replaced by a proxy of its shard's shape and dtype (same name, so the
   prologue, the gradients and the optimizer all see the sharded tensor). Under mixed precision Thunder traced
   the parameters in ``param_dtype``: the shard is in the master weights' dtype, and its gather yields
   ``param_dtype`` again, which the ops after it were traced with.
2. Walking the ops in order, right before the first op that reads a parameter of a unit not yet
   gathered, one ``unshard_unit`` is emitted for the whole unit.
3. Every read of a parameter is redirected to its gathered (full, unpadded) tensor.
4. Units that reshard after forward (ZeRO-3) are tagged ``RECOMPUTE_IN_BACKWARD``: Thunder's
   autodiff then gathers them again in the backward instead of saving them.

Options carried by each ``unshard_unit`` (see :mod:`fsdp_pass.ops.unshard`): the gather and reduce dtypes
of a :class:`~fsdp_pass.plan.mixed_precision.MixedPrecision`, the compute device when the shards are
offloaded (the sharded arguments then live on the offload device, while the trace the module's code made
computes on the compute device), the gradient-sync mode ``(mode, accumulators)`` of
:mod:`fsdp_pass.ops.grad_accumulation`, and HSDP's replicate group (:mod:`fsdp_pass.shard.mesh`); last, only when the
gather is quantized, its dtype and block (``MixedPrecision.gather_args``).
"""

from __future__ import annotations

from thunder.core.proxies import variableify
from thunder.core.symbol import BoundSymbolTag
from thunder.core.trace import TraceProvenance, from_trace, tracectx

from fsdp_pass.ops.grad_accumulation import REDUCE
from fsdp_pass.ops.unshard import unshard_unit
from fsdp_pass.shard.proxies import with_shape
from fsdp_pass.plan.mixed_precision import FULL_PRECISION, MixedPrecision, thunder_dtype
from fsdp_pass.plan.units import UnitPlan
from fsdp_pass.predicates import is_return, is_unpack_trivial


def sharded_arg_proxies(trace, plan: UnitPlan, shard_device=None) -> dict:
    """variableified full-shape argument -> proxy of the same name with the shard's shape and dtype (and,
    offloaded, the device the shards live on)."""
    param_of_arg = plan.param_of_arg
    swap = {}
    for a in trace.args:
        if getattr(a, "name", None) in param_of_arg:
            spec = plan.sharding.param(param_of_arg[a.name])
            swap[variableify(a)] = with_shape(a, spec.layout.shard_shape, shard_device, spec.dtype)
    return swap


def _unshard_op(new, unit, plan: UnitPlan, shards, group, precision, compute_device, grad_sync, replicate_group):
    """The ``unshard_unit`` bound symbol of ``unit``, traced into ``new`` (not appended) -> (bsym, fulls)."""
    shapes = tuple(plan.sharding.param(p).layout.shape for p in unit.params)
    mode, _ = grad_sync
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
            None if mode == REDUCE else grad_sync,
            replicate_group,
            *precision.gather_args(),
        )
    (bsym,) = new.pop_scope()
    if unit.reshard_after_forward:
        bsym.tags.add(BoundSymbolTag.RECOMPUTE_IN_BACKWARD)
    return bsym, fulls


def _return_of(bsym, gathered: dict, sharded: dict):
    """The return: outputs read gathered tensors; ``flat_args`` name the (sharded) inputs the gradients are
    for. Swap maps match proxies by name and a shard keeps its parameter's name, so the two are rebuilt
    separately."""
    (ret,) = bsym.from_bsym_swap_proxies(gathered).args
    ret = {**ret, "flat_args": [sharded.get(variableify(a), a) for a in bsym.args[0]["flat_args"]]}
    return bsym.from_bsym(args=(ret,))


def insert_unshards(
    trace,
    plan: UnitPlan,
    group,
    *,
    precision: MixedPrecision = FULL_PRECISION,
    compute_device: str | None = None,
    shard_device: str | None = None,
    grad_sync: tuple = (REDUCE, None),
    replicate_group=None,
):
    """``compute_device``, ``shard_device``: where the step computes and where the shards live, when the
    shards are offloaded (None otherwise); ``grad_sync``: ``(mode, accumulators)``, the gradient-sync mode
    this trace is compiled for; ``replicate_group``: HSDP's replicate group (None: no replicas)."""
    sharded = sharded_arg_proxies(trace, plan, shard_device)
    arg_of_param = {param: arg for arg, param in plan.param_of_arg.items()}
    unit_of_arg = {arg_of_param[p]: u for u in plan.units for p in u.params}
    sharded_by_name = {v.proxy.name: s for v, s in sharded.items()}
    full_by_name = {v.proxy.name: v for v in sharded}

    new = from_trace(trace)
    new.args = tuple(sharded.get(variableify(a), a) for a in trace.args)
    gathered: dict = {}  # variableified full-shape argument -> gathered full tensor
    done: set[str] = set()
    for bsym in trace.bound_symbols:
        if is_unpack_trivial(bsym):
            new.bound_symbols.append(bsym.from_bsym_swap_proxies(sharded))
            continue
        if is_return(bsym):
            new.bound_symbols.append(_return_of(bsym, gathered, sharded))
            continue
        for p in bsym.flat_proxy_args:
            unit = unit_of_arg.get(p.name)
            if unit is None or unit.name in done:
                continue
            args = [arg_of_param[name] for name in unit.params]
            op, fulls = _unshard_op(
                new, unit, plan, [sharded_by_name[a] for a in args], group, precision, compute_device, grad_sync,
                replicate_group,
            )
            new.bound_symbols.append(op)
            gathered.update({full_by_name[a]: full for a, full in zip(args, fulls)})
            done.add(unit.name)
        new.bound_symbols.append(bsym.from_bsym_swap_proxies(gathered))

    new.set_provenance(TraceProvenance(f"fsdp_pass: insert unshards ({len(done)} units)"))
    return new
