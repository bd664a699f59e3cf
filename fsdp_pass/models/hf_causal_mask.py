"""Hugging Face transformers 5's causal mask, traced by ``thunder.jit``: the mask and ``is_causal`` eager has.

transformers 5 builds a decoder's attention mask in ``transformers/masking_utils.py``. Eager decides on values:
when no token is padded and the positions count up by one in every row, it passes no mask and SDPA's
``is_causal=True``, which the flash kernels take. Under a compiler (``torch.compiler.is_compiling()``, which
Thunder's interpreter answers True) it cannot read values, and keeps the mask wherever the decision reads them:

- ``find_packed_sequence_indices(position_ids)`` returns the packed-sequence ids it would drop in eager (it cannot
  read them to see that they are all 0), which then turns the shortcut off;
- ``_ignore_causal_mask_sdpa(padding_mask, q_length, kv_length, ...)`` answers False for any padding mask, even
  all ones (what a tokenizer and HF's Trainer pass).

So every layer gets a boolean ``(batch, 1, q, kv)`` mask and ``is_causal=False``, and Thunder's SDPA runs the
memory-efficient kernel with the mask expanded per head. Measured on an H100 (TinyLlama-1.1B's shape, bfloat16,
2 x 2048 tokens, transformers 5.17.0): 65 ms of attention and 24 ms of mask copies per forward + backward, where
FSDP2 + torch.compile's attention took 9 ms.

The values are there while Thunder traces: positions the model makes from ``torch.arange`` are the same for
every call the compile serves, and a mask made from an argument has this call's value
(:mod:`fsdp_pass.models.trace_values`). :func:`causal_mask_lookasides` gives Thunder lookasides (it runs them
instead of interpreting the functions) that take transformers' own functions, outside the interpreter, to those
values: eager's answer, for every input.

1. ``find_packed_sequence_indices``: the positions' value (:func:`~fsdp_pass.models.trace_values.known_value`)
   given to transformers' function. None (one sequence per row) is returned as eager returns it; otherwise the
   function is interpreted on the positions, so the trace computes the ids, and the mask keeps each sequence to
   itself. Positions made inside the model depend on nothing else; positions the caller passes are checked by
   the prologue on every call (:func:`~fsdp_pass.models.trace_values.hold_on_every_call`): a call whose
   positions decide otherwise gets the other compile.
2. ``_ignore_causal_mask_sdpa``: transformers' rule on the lengths and offsets (plain numbers, which the
   prologue checks where they come from shapes) and the padding mask's value. A mask of all ones leaves the
   mask to ``is_causal`` as in eager, held by a prologue check as in step 1; where no mask at all keeps the mask
   (a sliding window shorter than the sequence) no value can drop it, and no check is added.
3. ``use_gqa_in_sdpa`` answers False: with no mask transformers would pass ``enable_gqa=True`` to
   ``scaled_dot_product_attention``, which Thunder's (0.2.6) does not take; it repeats the key and value heads
   itself instead, as it does where a mask is given and as transformers 4 always did.

Where no value is known (an argument on the meta device in a dry run, positions made from parameters, the
``same_input`` cache option) transformers' own function is interpreted: the mask is kept, the answer is still
eager's numbers. With transformers 4 (no ``masking_utils`` with these functions; 4.52 passes ``is_causal=True``
under Thunder) or no transformers imported it adds nothing; a transformers whose ``masking_utils`` lacks one of the
functions gets a warning that names it (:func:`causal_mask_lookasides`).
:func:`~fsdp_pass.models.hf_tracing.trace_hf_models` applies them with the output-capture lookasides.
"""

from __future__ import annotations

import functools
import sys
import types
import warnings
from numbers import Number
from types import ModuleType

from thunder.core.interpreter import _interpret_call_with_unwrapping
from thunder.core.proxies import NumberProxy, TensorProxy

from fsdp_pass.models.trace_values import hold_on_every_call, known_value

MASKING_MODULE = "transformers.masking_utils"  # transformers >= 5
PACKED_SEQUENCES = "find_packed_sequence_indices"
SKIP_CAUSAL_MASK = "_ignore_causal_mask_sdpa"
SDPA_MODULE = "transformers.integrations.sdpa_attention"
GQA_IN_SDPA = "use_gqa_in_sdpa"
WITHOUT = {  # what a jitted model does where the lookaside is missing
    PACKED_SEQUENCES: "every layer's attention gets an explicit mask (is_causal=False): right, but slower",
    SKIP_CAUSAL_MASK: "a padding mask of all ones keeps an explicit mask (is_causal=False): right, but slower",
    GQA_IN_SDPA: "a model with fewer key/value heads than query heads fails to trace where it has no mask "
    "(transformers passes enable_gqa=True, which Thunder's scaled_dot_product_attention does not take)",
}


def causal_mask_lookasides(masking: ModuleType | None = None, sdpa: ModuleType | None = None) -> dict:
    """``{function: replacement}`` for ``masking``'s ``find_packed_sequence_indices`` and
    ``_ignore_causal_mask_sdpa`` and ``sdpa``'s ``use_gqa_in_sdpa``; the modules are transformers'
    ``masking_utils`` and ``integrations.sdpa_attention`` where imported. Without ``masking_utils``
    (transformers 4, or none imported) ``{}``; a function missing from an imported module (transformers renamed
    it) is left out with a warning that names it and what the jitted model does without it."""
    masking = masking if masking is not None else sys.modules.get(MASKING_MODULE)
    if masking is None:
        return {}
    sdpa = sdpa if sdpa is not None else sys.modules.get(SDPA_MODULE)
    found = {name: _function(module, name) for module, name in
             ((masking, PACKED_SEQUENCES), (masking, SKIP_CAUSAL_MASK), (sdpa, GQA_IN_SDPA))}
    lookasides = {}
    if (packed := found[PACKED_SEQUENCES]) is not None:
        lookasides[packed] = functools.partial(_packed_sequences, packed, _interpreted(packed))
    if (skip := found[SKIP_CAUSAL_MASK]) is not None:
        lookasides[skip] = functools.partial(_skips_causal_mask, skip, _interpreted(skip))
    if (gqa := found[GQA_IN_SDPA]) is not None:
        lookasides[gqa] = _repeats_heads_itself
    return lookasides


def _function(module: ModuleType | None, name: str) -> types.FunctionType | None:
    function = getattr(module, name, None)
    if isinstance(function, types.FunctionType):
        return function
    version = getattr(sys.modules.get("transformers"), "__version__", "(version unknown)")
    where = getattr(module, "__name__", SDPA_MODULE)
    warnings.warn(
        f"fsdp_pass: transformers {version} has no function {where}.{name} (renamed or removed?), so thunder.jit "
        f"runs it without fsdp_pass's lookaside (fsdp_pass/models/hf_causal_mask.py): {WITHOUT[name]}. "
        "Install the transformers of fsdp_pass's constraints.txt, or report the new name.",
        stacklevel=3,
    )
    return None


def _packed_sequences(original, interpreted, position_ids):
    known = known_value(position_ids) if isinstance(position_ids, TensorProxy) else None
    if known is not None:
        one_per_row = original(known.value) is None  # outside the interpreter: eager's answer
        decide = functools.partial(_one_sequence_per_row, original)
        if hold_on_every_call(known, decide, one_per_row, "transformers: one sequence per row") and one_per_row:
            return None
    return _interpret_call_with_unwrapping(interpreted, position_ids)  # the ids, computed by the trace


def _one_sequence_per_row(original, position_ids) -> bool:
    return original(position_ids) is None


def _skips_causal_mask(rule, interpreted, padding_mask, *args, **kwargs):
    if all(_plain(a) for a in (*args, *kwargs.values())):
        if padding_mask is None or not rule(None, *args, **kwargs):
            return rule(None, *args, **kwargs)  # outside the interpreter: eager's decision on the shapes
        known = known_value(padding_mask) if isinstance(padding_mask, TensorProxy) else None
        if known is not None:
            skips = bool(rule(known.value, *args, **kwargs))
            decide = functools.partial(_rule_on, rule, args, kwargs)
            if hold_on_every_call(known, decide, skips, "transformers: the causal mask left to is_causal"):
                return skips
    return _interpret_call_with_unwrapping(interpreted, padding_mask, *args, **kwargs)


def _rule_on(rule, args, kwargs, padding_mask) -> bool:
    return bool(rule(padding_mask, *args, **kwargs))


def _repeats_heads_itself(*args, **kwargs) -> bool:
    return False  # no enable_gqa: transformers repeats the key and value heads before the call


def _plain(value) -> bool:
    """A Python number or None: known while tracing, and checked by the prologue where it comes from a shape."""
    return value is None or (isinstance(value, Number) and not isinstance(value, NumberProxy))


def _interpreted(function: types.FunctionType) -> types.FunctionType:
    """A copy of ``function`` that is not a key of the lookasides: interpreting it runs transformers' own code."""
    copy = types.FunctionType(
        function.__code__, function.__globals__, function.__name__, function.__defaults__, function.__closure__
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy
