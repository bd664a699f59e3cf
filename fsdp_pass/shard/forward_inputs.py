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
   refuses a call that would make a transformers model build a KV cache (:mod:`~fsdp_pass.models.hf_kv_cache`:
   a step needs none and Thunder cannot trace it), checks their devices
   (:func:`~fsdp_pass.shard.input_checks.check_input_devices`), does step 1 when mixed precision casts (the
   prologue trace then shows the inputs it checks in ``param_dtype``), calls the compiled step (under :func:`~fsdp_pass.models.thunder_gc_guard.gc_guard`: Thunder
   compiles there), and when Thunder fails to trace it, names the inputs that explain the failure
   (:func:`~fsdp_pass.shard.input_checks.explain_trace_failure`). A dry run and the functional path's trace
   cast the same way (:func:`inputs_of_step`).
"""

from __future__ import annotations

import time

import thunder
import torch
from torch.utils._pytree import tree_map

from fsdp_pass.models.hf_kv_cache import check_no_kv_cache
from fsdp_pass.models.thunder_gc_guard import gc_guard
from fsdp_pass.plan.mixed_precision import MixedPrecision
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
        check_no_kv_cache(thunder_module._model, kwargs)
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
