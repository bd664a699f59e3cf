"""Pass: run the forward in the mixed-precision compute dtype.

``cast_compute(trace, plan, precision) -> trace`` runs on the forward trace after
:func:`~fsdp_pass.passes.insert_unshards.insert_unshards`, whose gathers already return the
parameters in ``precision.param_dtype``:

1. Right after each floating input (or buffer) is unpacked, one ``to(x, param_dtype)`` casts it, so no
   op mixes the gathered low-precision parameters with float32 activations. The parameter arguments
   (the float32 shards) are left alone: only their gather casts them.
2. Every later op is traced again on the new inputs, so the dtypes each op's result carries (and
   everything Thunder derives from them: the backward, the lowering) follow the casts. Tags and
   headers are kept (the ``RECOMPUTE_IN_BACKWARD`` of ZeRO-3's gathers, their labels).
3. Floating outputs are cast to ``precision.output_dtype`` when one is set. The ``flat_args`` of the
   return keep naming the original inputs: the gradients are for them, through the casts.
"""

from __future__ import annotations

import thunder.torch as ltorch
from thunder.core.proxies import TensorProxy, variableify
from thunder.core.pytree import tree_flatten, tree_map
from thunder.core.trace import TraceProvenance, from_trace, tracectx

from fsdp_pass.plan.mixed_precision import MixedPrecision, thunder_dtype
from fsdp_pass.plan.units import UnitPlan
from fsdp_pass.predicates import is_float_tensor, is_return, is_unpack_trivial, is_unshard_unit


class _Recast:
    """The new trace being written, and what replaces each proxy of the old one."""

    def __init__(self, trace):
        self.new = from_trace(trace)
        self.swap: dict = {}  # variableified proxy of the old trace -> its replacement

    def emit(self, fn, *args, **kwargs):
        self.new.push_scope([])
        out = fn(*args, **kwargs)
        self.new.bound_symbols.extend(self.new.pop_scope())
        return out

    def cast(self, x, dtype):
        return self.emit(ltorch.to, x, dtype) if is_float_tensor(x) and x.dtype != dtype else x

    def input(self, bsym, compute, param_args) -> None:
        """Step 1: an unpacked input, cast right after (parameter shards are left to their gathers)."""
        self.new.bound_symbols.append(bsym)
        x = bsym.output
        if compute is not None and getattr(x, "name", None) not in param_args:
            cast_x = self.cast(x, compute)
            if cast_x is not x:
                self.swap[variableify(x)] = cast_x

    def returned(self, bsym, output_dtype) -> None:
        """Step 3: the outputs, replaced and cast to ``output_dtype``."""
        (ret,) = bsym.args
        swap = self.swap
        out = tree_map(lambda x: swap.get(variableify(x), x) if isinstance(x, TensorProxy) else x, ret["output"])
        if output_dtype is not None:
            out = tree_map(lambda x: self.cast(x, output_dtype), out)
        self.new.bound_symbols.append(bsym.from_bsym(args=({**ret, "output": out},)))

    def traced_again(self, bsym) -> None:
        """Step 2: an op reading a replaced proxy, traced again on the replacements (tags and header kept)."""
        again = bsym.from_bsym_swap_proxies(self.swap)
        self.new.push_scope([])
        result = again.sym(*again.args, **again.kwargs)
        (traced,) = self.new.pop_scope()
        self.new.bound_symbols.append(traced.from_bsym(tags=set(bsym.tags), header=bsym.header))
        olds, _ = tree_flatten(bsym.output)
        news, _ = tree_flatten(result)
        for old, rep in zip(olds, news):
            if isinstance(old, TensorProxy) and rep is not old:
                self.swap[variableify(old)] = rep


def cast_compute(trace, plan: UnitPlan, precision: MixedPrecision) -> object:
    compute = thunder_dtype(precision.param_dtype)
    output = thunder_dtype(precision.output_dtype)
    if compute is None and output is None:
        return trace
    param_args = frozenset(plan.param_of_arg)
    recast = _Recast(trace)
    with tracectx(recast.new):
        for bsym in trace.bound_symbols:
            if is_unpack_trivial(bsym):
                recast.input(bsym, compute, param_args)
            elif is_return(bsym):
                recast.returned(bsym, output)
            elif is_unshard_unit(bsym):  # its outputs are already in the gather dtype: their readers are traced again
                recast.new.bound_symbols.append(bsym)
                recast.swap.update({variableify(p): p for p in bsym.flat_proxy_outs})
            elif any(variableify(p) in recast.swap for p in bsym.flat_proxy_args):
                recast.traced_again(bsym)
            else:
                recast.new.bound_symbols.append(bsym)
    recast.new.set_provenance(TraceProvenance(f"fsdp_pass: compute in {precision.describe()}"))
    return recast.new
