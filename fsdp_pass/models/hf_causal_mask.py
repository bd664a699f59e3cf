"""Hugging Face transformers 5's causal mask, traced by ``thunder.jit``: ``is_causal`` where eager has it.

transformers 5 builds a decoder's attention mask in ``transformers/masking_utils.py``. In eager, when no token is
padded and the positions count up by one in every row, it passes no mask and SDPA's ``is_causal=True``, which the
flash kernels take. Under a compiler (``torch.compiler.is_compiling()``, which Thunder's interpreter answers True) it
declines both shortcuts, because an exported graph would bake in a decision made on one example's values:

- ``find_packed_sequence_indices(position_ids)`` returns the packed-sequence ids it would drop in eager (it cannot
  read them to see that they are all 0), which then turns the shortcut off;
- ``_ignore_causal_mask_sdpa(padding_mask, q_length, kv_length, ...)`` answers False without looking.

So every layer gets a boolean ``(batch, 1, q, kv)`` mask and ``is_causal=False``. Thunder's SDPA executor then
cannot use flash attention: it runs the memory-efficient kernel with the mask expanded per head. Measured on an
H100 (TinyLlama-1.1B's shape, bfloat16, 2 x 2048 tokens, transformers 5.17.0): 65 ms of attention and 24 ms of mask
copies per forward + backward, where FSDP2 + torch.compile's attention took 9 ms.

Neither reason holds under Thunder: a compiled function is reused only for inputs of the shapes it was traced
with (its prologue checks them), and what the shortcuts need is known while tracing.
:func:`causal_mask_lookasides` gives Thunder lookasides (it runs them instead of interpreting the functions):

1. ``find_packed_sequence_indices`` returns None, as eager does, when the traced function made the positions itself
   from an ``arange`` of step 1 (through additions of a number and reshapes that keep each row in order): the
   model's own positions when the caller passes none. Positions the caller passes (packed sequences, say) go to
   transformers' own code, interpreted, which keeps the mask.
2. ``_ignore_causal_mask_sdpa`` runs transformers' own rule outside the interpreter (where
   ``torch.compiler.is_compiling()`` is False) when no padding mask is given and the lengths and offsets are plain
   numbers: a decision on shapes, which the prologue checks. With a padding mask it keeps the mask, as transformers
   does under a compiler.
3. ``use_gqa_in_sdpa`` answers False: with no mask transformers would pass ``enable_gqa=True`` to
   ``scaled_dot_product_attention``, which Thunder's (0.2.6) does not take; it repeats the key and value heads
   itself instead, as it does where a mask is given and as transformers 4 always did.

With transformers 4 (no ``masking_utils`` with these functions; 4.52 passes ``is_causal=True`` under Thunder) or no
transformers imported it adds nothing. :func:`~fsdp_pass.models.hf_tracing.trace_hf_models` applies it with the
output-capture lookasides.
"""

from __future__ import annotations

import functools
import sys
import types
from numbers import Number
from types import ModuleType

from thunder.core.interpreter import _interpret_call_with_unwrapping
from thunder.core.proxies import NumberProxy, TensorProxy
from thunder.core.trace import get_tracectx

MASKING_MODULE = "transformers.masking_utils"  # transformers >= 5
PACKED_SEQUENCES = "find_packed_sequence_indices"
SKIP_CAUSAL_MASK = "_ignore_causal_mask_sdpa"
SDPA_MODULE = "transformers.integrations.sdpa_attention"
GQA_IN_SDPA = "use_gqa_in_sdpa"

_ARANGE = "torch.arange"
_SHIFTS = ("torch.add", "torch.sub")  # by a number: each row still counts up by one
_IN_ORDER = ("torch.unsqueeze", "torch.reshape", "torch.Tensor.view")  # C-order kept: each last-axis row in order
_EXPAND = "torch.Tensor.expand"  # new leading axes or size-1 ones; the last axis' size must stay


def causal_mask_lookasides(masking: ModuleType | None = None, sdpa: ModuleType | None = None) -> dict:
    """``{function: replacement}`` for ``masking``'s ``find_packed_sequence_indices`` and
    ``_ignore_causal_mask_sdpa`` and ``sdpa``'s ``use_gqa_in_sdpa``; the modules are transformers'
    ``masking_utils`` and ``integrations.sdpa_attention`` where imported, and without them (or without those
    functions) ``{}``."""
    masking = masking if masking is not None else sys.modules.get(MASKING_MODULE)
    sdpa = sdpa if sdpa is not None else sys.modules.get(SDPA_MODULE)
    packed = getattr(masking, PACKED_SEQUENCES, None)
    skip = getattr(masking, SKIP_CAUSAL_MASK, None)
    gqa = getattr(sdpa, GQA_IN_SDPA, None)
    if not all(isinstance(f, types.FunctionType) for f in (packed, skip, gqa)):
        return {}
    return {
        packed: functools.partial(_packed_sequences, _interpreted(packed)),
        skip: functools.partial(_skips_causal_mask, skip, _interpreted(skip)),
        gqa: _repeats_heads_itself,
    }


def _packed_sequences(interpreted, position_ids):
    if isinstance(position_ids, TensorProxy) and counts_up_by_one(position_ids):
        return None  # no packed sequences: eager's answer for these positions
    return _interpret_call_with_unwrapping(interpreted, position_ids)


def _skips_causal_mask(rule, interpreted, padding_mask, *args, **kwargs):
    if padding_mask is None and all(_plain(a) for a in (*args, *kwargs.values())):
        return rule(padding_mask, *args, **kwargs)  # outside the interpreter: eager's decision on the shapes
    return _interpret_call_with_unwrapping(interpreted, padding_mask, *args, **kwargs)


def _repeats_heads_itself(*args, **kwargs) -> bool:
    return False  # no enable_gqa: transformers repeats the key and value heads before the call


def counts_up_by_one(proxy: TensorProxy) -> bool:
    """Whether the trace being built made ``proxy`` from an ``arange`` of step 1 by ops that keep every row of its
    last axis counting up by one (shifts by a number, unsqueeze, reshape, view, expand of other axes)."""
    trace = get_tracectx()
    if trace is None:
        return False
    producers = {out.name: bsym for bsym in trace.bound_symbols for out in bsym.flat_proxy_outs}
    while True:
        bsym = producers.get(proxy.name)
        if bsym is None:  # an input of the traced function, or made outside it
            return False
        kind = bsym.sym.id
        if kind == _ARANGE:
            step = bsym.args[2] if len(bsym.args) > 2 else bsym.kwargs.get("step", 1)
            return not isinstance(step, NumberProxy) and step == 1
        tensors = [a for a in bsym.flat_args if isinstance(a, TensorProxy)]
        if len(tensors) != 1:
            return False
        source = tensors[0]
        if kind in _SHIFTS:
            if not all(_plain(a) for a in bsym.flat_args if a is not source):
                return False
        elif kind == _EXPAND:
            if bsym.output.shape[-1] != source.shape[-1]:
                return False
        elif kind not in _IN_ORDER:
            return False
        proxy = source


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
