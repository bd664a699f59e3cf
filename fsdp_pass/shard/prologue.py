"""Pass: make the prologue expect (and check) the sharded parameters the module now holds.

``shard_prologue(prologue, sharding, device, grad_sync) -> prologue``:

1. The tensor produced by ``module.get_parameter(name)`` gets its shard's shape and dtype (the master weights'
   dtype: Thunder traced the module in a mixed-precision ``param_dtype``), and the metadata check on it expects
   that shape, that dtype and the shard's device (``device``; None keeps the device it checked).
2. One ``check_grad_sync(accumulators, mode)`` before the return (when ``grad_sync`` names the
   transform's accumulators): this compiled variant runs only while :func:`fsdp_pass.no_sync` is in the
   mode it was compiled for (Thunder's cache tries the next variant, or compiles one, when the check
   fails).
"""

from __future__ import annotations

from thunder.core import devices
from thunder.core.dtypes import to_torch_dtype
from thunder.core.proxies import variableify
from thunder.core.trace import TraceProvenance, from_trace

from fsdp_pass.ops.grad_accumulation import grad_sync_check
from fsdp_pass.shard.proxies import with_shape
from fsdp_pass.plan.sharding import ShardingPlan
from fsdp_pass.predicates import is_return, is_shape_check, is_unpack_parameter


def shard_prologue(prologue, sharding: ShardingPlan, device, grad_sync: tuple):
    """``grad_sync``: the ``(mode, accumulators)`` the computation trace was built for."""
    mode, accumulators = grad_sync
    device_str = None if device is None else devices.to_device(device).device_str()
    swap = {}
    for bsym in prologue.bound_symbols:
        if is_unpack_parameter(bsym) and bsym.args[1] in sharding:
            out = bsym.output
            spec = sharding.param(bsym.args[1])
            swap[variableify(out)] = with_shape(out, spec.layout.shard_shape, device, spec.dtype)

    new = from_trace(prologue)
    for bsym in prologue.bound_symbols:
        nbsym = bsym.from_bsym_swap_proxies(swap)
        if is_shape_check(bsym) and variableify(bsym.args[0]) in swap:
            tensor, _, checked_device, _, *rest = nbsym.args
            nbsym = nbsym.from_bsym(
                args=(tensor, tuple(tensor.shape), device_str or checked_device, to_torch_dtype(tensor.dtype), *rest)
            )
        if is_return(bsym) and accumulators is not None:
            new.bound_symbols.append(grad_sync_check(accumulators, mode))
        new.bound_symbols.append(nbsym)
    new.set_provenance(TraceProvenance("fsdp_pass: sharded parameter checks"))
    return new
