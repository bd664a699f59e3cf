"""Attention on the meta device as a GPU would run it, for dry runs that target CUDA.

On CUDA, Thunder's ``sdpa`` executor runs ``scaled_dot_product_attention`` as one of torch's fused kernels
(flash attention, or the memory-efficient kernel), which keeps for the backward the output and one
log-sum-exp per row (float32, ``[b, h, s]`` rounded up) instead of the ``b·h·s·s`` probabilities a decomposed
attention keeps. Which kernel it takes is torch's choice, asked of torch with fake CUDA tensors
(``thunder.executors.utils._fused_sdp_choice`` -> ``torch.backends.cuda.can_use_flash_attention`` /
``can_use_efficient_attention``). On the meta device, or on a machine without a GPU, torch answers "math"
(decomposed), so the executor's checker declines and a dry run would trace the decomposition.

:func:`sdpa_on_meta_as_cuda` answers that one question for meta tensors as torch does on an H100 (sm90)
with its default settings (every kernel enabled), and leaves everything else to Thunder's executor:

1. flash attention for float16 / bfloat16 inputs without an additive mask and with a head dimension of at most
   256 shared by query, key and value (torch's flash checks; Thunder's executor pads the head dimension to a
   multiple of 8 itself);
2. else the memory-efficient kernel for float32 / float16 / bfloat16 inputs whose query and key head
   dimensions agree (it takes masks and float32);
3. else "math": the executor declines, and the attention is decomposed as on a GPU that has neither.

What is *modelled* is only this choice (the rules above, not torch asked on a GPU). What is *traced* is the
rest: the sdpa executor's own forward and backward symbols with their meta functions, so the saved
tensors (output, log-sum-exp, random-number state) have the shapes and dtypes the CUDA kernels return.
Tensors on any other device are answered by torch as before.
"""

from __future__ import annotations

from contextlib import contextmanager

import thunder.core.dtypes as dtypes
import thunder.executors.sdpaex as sdpaex
from thunder.executors.utils import SpdaBackend

FLASH_DTYPES = (dtypes.float16, dtypes.bfloat16)
MEMORY_EFFICIENT_DTYPES = (dtypes.float32, dtypes.float16, dtypes.bfloat16)
FLASH_MAX_HEAD_DIM = 256


def _same_dtype(dtype, choices) -> bool:
    return any(dtypes.are_same_dtypes(dtype, d, weak_and_strong_are_equivalent=True) for d in choices)


def cuda_sdpa_kernel(query, key, value, attn_mask=None) -> SpdaBackend:
    """The kernel torch takes on an H100 for these query / key / value (proxies of 4-D tensors), by the rules of
    this module's docstring."""
    head_dims = {query.shape[-1], key.shape[-1], value.shape[-1]}
    if (
        _same_dtype(query.dtype, FLASH_DTYPES)
        and attn_mask is None
        and len(head_dims) == 1
        and query.shape[-1] <= FLASH_MAX_HEAD_DIM
    ):
        return SpdaBackend.FLASH_ATTENTION
    if _same_dtype(query.dtype, MEMORY_EFFICIENT_DTYPES) and query.shape[-1] == key.shape[-1]:
        return SpdaBackend.MEMORY_EFFICIENT
    return SpdaBackend.MATH


def _on_meta(*tensors) -> bool:
    present = [t for t in tensors if t is not None]
    return bool(present) and all(t.device.type == "meta" for t in present)


@contextmanager
def sdpa_on_meta_as_cuda():
    """While inside, Thunder's sdpa executor picks its kernel for meta tensors as torch does on an H100."""
    asked_of_torch = sdpaex._fused_sdp_choice

    def choice(query, key, value, attn_mask, dropout_p=0.0, is_causal=False, scale=None):
        if _on_meta(query, key, value, attn_mask):
            return cuda_sdpa_kernel(query, key, value, attn_mask)
        return asked_of_torch(query, key, value, attn_mask, dropout_p, is_causal, scale)

    sdpaex._fused_sdp_choice = choice
    try:
        yield
    finally:
        sdpaex._fused_sdp_choice = asked_of_torch
