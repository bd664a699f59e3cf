"""Where every call's inputs enter the jitted model: checked, and cast to mixed precision's ``param_dtype``.

FSDP2 casts the floating tensors among a root module's inputs to ``param_dtype`` before its forward runs, so the
module's code starts from them. Here the same happens one step earlier, before the jitted module's compiled step
is called: Thunder then traces the module on inputs of that dtype, and every cast the module's code makes of
them is traced as written (a cast added to a trace made from float32 inputs would replay the ops recorded for
float32, where a cast to float32 was no op at all).

1. :func:`cast_floating_inputs`: ``(args, kwargs)`` with every floating tensor, at any depth of lists, tuples and
   dicts, cast to the dtype; integer tensors (token ids), masks and everything else unchanged. The casts are
   torch ops, so the inputs' gradients flow back through them, in the inputs' own dtype.
2. :func:`check_and_cast_inputs_on_call`: the jitted module's ``forward`` (an instance attribute, as for its
   state-dict methods: this ThunderModule only) is where every call's inputs pass before the compiled step. It
   checks their devices (:func:`~fsdp_pass.shard.input_checks.check_input_devices`), does step 1 when mixed
   precision casts (the prologue trace then shows the inputs it checks in ``param_dtype``), calls the compiled
   step (under :func:`~fsdp_pass.models.thunder_gc_guard.gc_guard`: Thunder compiles there), and when Thunder
   fails to trace it, names the inputs that explain the failure
   (:func:`~fsdp_pass.shard.input_checks.explain_trace_failure`). A dry run and the functional path's trace
   cast the same way (:func:`inputs_of_step`).
3. :func:`cast_inputs_at_blocks`: FSDP2 casts the floating inputs of every module it wraps, at each call, not only
   the root's. The modules an FSDP2 recipe wraps are the model's repeated blocks (a decoder's layers: what
   :meth:`~fsdp_pass.plan.module_tree.ModuleTree.repeated_blocks` finds, and ``units="blocks"`` makes units); each
   gets a forward pre-hook that casts the floating tensors among its arguments, which Thunder traces as the
   block's first ops: a block handed a float32 tensor (a residual kept in float32, a float32 table) computes in
   ``param_dtype`` as under FSDP2. The casts sit at the blocks whatever units the plan chooses: units are chosen
   after tracing, from the trace, and what a step computes does not depend on how its parameters are gathered.
"""

from __future__ import annotations

import functools
import time

import thunder
import torch
from torch.utils._pytree import tree_map

from fsdp_pass.models.thunder_gc_guard import gc_guard
from fsdp_pass.plan.mixed_precision import MixedPrecision
from fsdp_pass.plan.module_tree import ModuleTree
from fsdp_pass.shard.input_checks import check_input_devices, explain_trace_failure, named_tensors


def cast_floating_inputs(args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    """Step 1: ``(args, kwargs)`` with their floating tensors in ``dtype``."""

    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype else x

    return tree_map(cast, tuple(args)), tree_map(cast, dict(kwargs))


def inputs_of_step(args: tuple, kwargs: dict, precision: MixedPrecision) -> tuple[tuple, dict]:
    """What the compiled step receives of a call ``(args, kwargs)`` under ``precision``: step 1 when it computes
    in another dtype and casts forward inputs, else the inputs as they are. The jitted module's calls, the dry run
    and the functional path's trace all go through here."""
    if precision.param_dtype is None or not precision.cast_forward_inputs:
        return args, kwargs
    return cast_floating_inputs(args, kwargs, precision.param_dtype)


def compute_dtype(sharding, precision: MixedPrecision) -> torch.dtype | None:
    """The dtype the step computes in: mixed precision's ``param_dtype``, else the one dtype of the model's floating
    parameters (None when they have several)."""
    if precision.param_dtype is not None:
        return precision.param_dtype
    floating = {spec.dtype for spec in sharding.params if spec.dtype.is_floating_point}
    return floating.pop() if len(floating) == 1 else None


def _tracing_failed(stats, call_started: int) -> bool:
    """Whether Thunder began tracing during the call that started at ``call_started`` (ns) and never finished."""
    if stats is None:
        return False
    started, stopped = stats.last_trace_tracing_start, stats.last_trace_tracing_stop
    return started >= call_started and stopped < started


def check_and_cast_inputs_on_call(thunder_module, fsdp) -> None:
    """Step 2: every call of the jitted module checks, casts (when ``fsdp``'s mixed precision does) and explains."""
    compiled_forward = type(thunder_module).forward
    names = fsdp.argument_names  # the module's positional forward parameters, read once when it was sharded

    def forward(*args, **kwargs):
        precision = fsdp.options.mixed_precision
        check_input_devices(args, kwargs, fsdp.model.device, names)
        if precision.param_dtype is not None:
            args, kwargs = inputs_of_step(args, kwargs, precision)
        started = time.perf_counter_ns()
        try:
            with gc_guard():  # Thunder compiles in here: no collection mid-way through its dict walks
                return compiled_forward(thunder_module, *args, **kwargs)
        except Exception as e:
            if not _tracing_failed(thunder.compile_stats(thunder_module), started):
                raise
            explained = explain_trace_failure(
                e, named_tensors(args, kwargs, names), compute_dtype(fsdp.model.sharding, precision)
            )
            if explained is None:
                raise
            raise explained from e

    thunder_module.forward = forward


BLOCK_CASTS = "_fsdp_pass_block_casts"  # the hooks' handles, on the root module


def cast_inputs_at_blocks(module: torch.nn.Module, precision: MixedPrecision) -> list[str]:
    """Step 3: the names of ``module``'s repeated blocks, each given a forward pre-hook that casts its floating
    tensor arguments to ``param_dtype`` (none when mixed precision does not cast forward inputs). Hooks an earlier
    call added are removed first."""
    for handle in getattr(module, BLOCK_CASTS, ()):
        handle.remove()
    if precision.param_dtype is None or not precision.cast_forward_inputs:
        setattr(module, BLOCK_CASTS, [])
        return []
    blocks = ModuleTree.of(module).repeated_blocks()
    hook = functools.partial(_cast_block_inputs, precision.param_dtype)
    handles = [module.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True) for name in blocks]
    setattr(module, BLOCK_CASTS, handles)
    return blocks


def _cast_block_inputs(dtype, block, args, kwargs):
    return _cast_floating(args, dtype), _cast_floating(kwargs, dtype)


def _cast_floating(value, dtype):
    """``value`` with the floating tensors in it, at any depth of tuples, lists and dicts, in ``dtype``. Written
    with comprehensions, not a tree map: Thunder's interpreter traces these, and ``map`` over a Python function
    runs it unseen (its casts would not reach the trace)."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (tuple, list)):
        items = [_cast_floating(v, dtype) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # a namedtuple: fields
    if isinstance(value, dict):
        return {k: _cast_floating(v, dtype) for k, v in value.items()}
    return value
