"""Pass: the forward's floating outputs in the mixed-precision ``output_dtype``.

``cast_compute(trace, precision) -> trace``. Nothing else of mixed precision is written into the trace by a
pass: Thunder traced the module with its parameters in ``param_dtype`` (:mod:`fsdp_pass.shard.module`) and its
floating inputs cast to it (:mod:`fsdp_pass.shard.forward_inputs`), so every op already carries the dtype the
module's own code gives it, and the gathers of :mod:`fsdp_pass.passes.insert_unshards` yield ``param_dtype``.

1. Each floating tensor the forward returns (under ``"output"``) that is not in ``output_dtype`` gets one
   ``to(x, output_dtype)`` right before the return, which returns the cast instead. The ``flat_args`` of the
   return keep naming the inputs: the gradients are for them, through the casts.
2. No ``output_dtype``: the trace is returned unchanged.
"""

from __future__ import annotations

import thunder.torch as ltorch
from thunder.core.pytree import tree_map
from thunder.core.trace import TraceProvenance, from_trace, tracectx

from fsdp_pass.plan.mixed_precision import MixedPrecision, thunder_dtype
from fsdp_pass.predicates import is_float_tensor, is_return


def cast_compute(trace, precision: MixedPrecision) -> object:
    output = thunder_dtype(precision.output_dtype)
    if output is None:
        return trace
    new = from_trace(trace)

    def cast(x):
        if not is_float_tensor(x) or x.dtype == output:
            return x
        new.push_scope([])
        out = ltorch.to(x, output)
        new.bound_symbols.extend(new.pop_scope())
        return out

    with tracectx(new):
        for bsym in trace.bound_symbols:
            if is_return(bsym):
                (ret,) = bsym.args
                bsym = bsym.from_bsym(args=({**ret, "output": tree_map(cast, ret["output"])},))
            new.bound_symbols.append(bsym)
    new.set_provenance(TraceProvenance(f"fsdp_pass: outputs in {precision.output_dtype}"))
    return new
