"""Mixed precision's ``cast_forward_inputs``: the model's floating inputs reach the compiled step in ``param_dtype``.

FSDP2 casts the floating tensors among a root module's inputs to ``param_dtype`` before its forward runs, so the
module's code starts from them. Here the same happens one step earlier, before the jitted module's compiled step
is called: Thunder then traces the module on inputs of that dtype, and every cast the module's code makes of
them is traced as written (a cast added to a trace made from float32 inputs would replay the ops recorded for
float32, where a cast to float32 was no op at all).

1. :func:`cast_floating_inputs`: ``(args, kwargs)`` with every floating tensor, at any depth of lists, tuples and
   dicts, cast to the dtype; integer tensors (token ids), masks and everything else unchanged. The casts are
   torch ops, so the inputs' gradients flow back through them, in the inputs' own dtype.
2. :func:`cast_floating_inputs_on_call`: the jitted module's ``forward`` does step 1 before the compiled step
   (an instance attribute, as for its state-dict methods: this ThunderModule only). The prologue trace shows
   the inputs it checks in ``param_dtype``. A dry run and the functional path's trace cast the same way
   (:func:`inputs_of_step`).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from fsdp_pass.plan.mixed_precision import MixedPrecision


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


def cast_floating_inputs_on_call(thunder_module, precision: MixedPrecision) -> None:
    """Step 2: when :func:`inputs_of_step` casts under ``precision``, the jitted module casts on every call."""
    if precision.param_dtype is None or not precision.cast_forward_inputs:
        return
    compiled_forward = type(thunder_module).forward

    def forward(*args, **kwargs):
        args, kwargs = inputs_of_step(args, kwargs, precision)
        return compiled_forward(thunder_module, *args, **kwargs)

    thunder_module.forward = forward
