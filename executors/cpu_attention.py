"""``cpu_attention``: ``scaled_dot_product_attention`` on CPU tensors as torch's CPU flash-attention kernel runs it.

Without an attention executor Thunder decomposes the attention into matmuls and a softmax, and its backward
reads the softmax's output: every layer keeps its ``b·h·s_q·s_k`` probabilities from the forward to the
backward. Eager PyTorch on the CPU runs ``aten._scaled_dot_product_flash_attention_for_cpu`` instead, which
keeps the output and one float32 log-sum-exp per query row (``b·h·s_q``), and whose backward kernel recomputes
the probabilities block by block. Thunder's own ``sdpa`` executor declines CPU tensors (its kernels are CUDA's).

This executor claims the attention where the CPU kernel computes what the decomposition computes and
otherwise declines, so Thunder decomposes it as before. In a printed trace it reads as two ops:

- ``cpu_flash_attention(q, k, v, attn_mask, is_causal, scale) -> (out, logsumexp)`` in the forward;
- ``cpu_flash_attention_backward(grad_out, q, k, v, out, logsumexp, attn_mask, is_causal, scale)
  -> (grad_q, grad_k, grad_v)`` in the backward, which is what the forward saves for: q, k, v, the output,
  the log-sum-exp and the mask (if any).

Both ops return contiguous ``[b, h, s, d]`` tensors. The kernels lay their results out otherwise (the output as
the query lies in memory, which after a rotary embedding of a transposed projection is ``[b, s, h, d]``; the
gradients always ``[b, s, h, d]``); the copy makes the layout the one the memory report
(:mod:`fsdp_pass.report.memory`, rule 2: an op's result is a new contiguous buffer) follows, so its prediction stays
the measured peak (a zoo Llama's reshape after the attention would otherwise be free where the report counts a copy).

What it takes (:func:`takes`): 4-D float32 / bfloat16 / float16 query, key and value on the CPU with the same
batch, heads and head size (no grouped-query broadcast: Hugging Face repeats the key and value heads first),
no dropout, and no mask or a mask that needs no gradient, of 2 or 4 dimensions broadcastable to
``(b, h, s_q, s_k)``, boolean or of the query's dtype (a boolean mask, True where a query attends, becomes the
additive mask the kernel reads inside both ops; the trace keeps the boolean one). Tensors on the meta device
are taken too: a dry run for the CPU traces there (:func:`fsdp_pass_executors.dry_run_choice`), and torch's
kernels have meta implementations, so the shapes a dry run sees are the ones a CPU run gets.
"""

from __future__ import annotations

import torch
import thunder.core.dtypes as dtypes
import thunder.torch as ltorch
from thunder.core.prims import OpTags
from thunder.core.proxies import TensorProxy
from thunder.core.transforms import get_grad, put_grads
from thunder.extend import OperatorExecutor, register_executor

from fsdp_pass.op_names import CPU_ATTENTION_BACKWARD_OP as BACKWARD_OP
from fsdp_pass.op_names import CPU_ATTENTION_EXECUTOR
from fsdp_pass.op_names import CPU_ATTENTION_OP as FORWARD_OP
KERNEL_DTYPES = (dtypes.float32, dtypes.bfloat16, dtypes.float16)
DEVICES = ("cpu", "meta")  # meta: a dry run standing for the CPU

cpu_attention_ex = OperatorExecutor(CPU_ATTENTION_EXECUTOR, version="0.1")
register_executor(cpu_attention_ex)


def _is(dtype, choices) -> bool:
    return any(dtypes.are_same_dtypes(dtype, d, weak_and_strong_are_equivalent=True) for d in choices)


def _mask_fits(mask, b: int, h: int, s_q: int, s_k: int) -> bool:
    """A mask the kernel reads: 2-D ``(s_q, s_k)`` or 4-D ``(b, h, s_q, s_k)``, each size full or 1."""
    full = {2: (s_q, s_k), 4: (b, h, s_q, s_k)}.get(len(mask.shape))
    return full is not None and all(int(n) in (1, m) for n, m in zip(mask.shape, full))


def takes(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None) -> bool:
    """Whether the CPU flash kernel computes this attention (the rules of the module docstring)."""
    tensors = [t for t in (query, key, value, attn_mask) if t is not None]
    if not all(isinstance(t, TensorProxy) for t in tensors):
        return False
    if len({t.device.type for t in tensors}) != 1 or query.device.type not in DEVICES:
        return False
    if any(len(t.shape) != 4 for t in (query, key, value)) or not _is(query.dtype, KERNEL_DTYPES):
        return False
    if not all(dtypes.are_same_dtypes(t.dtype, query.dtype) for t in (key, value)):
        return False
    (b, h, s_q, e), (s_k, s_v) = query.shape, (key.shape[2], value.shape[2])
    if tuple(key.shape) != (b, h, s_k, e) or tuple(value.shape) != (b, h, s_k, e) or s_v != s_k:
        return False
    if not isinstance(dropout_p, (int, float)) or dropout_p != 0.0 or not isinstance(is_causal, bool):
        return False
    if attn_mask is None:
        return True
    if is_causal or attn_mask.requires_grad or not _mask_fits(attn_mask, b, h, s_q, s_k):
        return False
    return _is(attn_mask.dtype, (dtypes.bool8,)) or dtypes.are_same_dtypes(attn_mask.dtype, query.dtype)


def _forward_meta(query, key, value, attn_mask, is_causal: bool, scale):
    b, h, s_q, _ = query.shape
    out = TensorProxy(like=query, shape=tuple(query.shape[:3]) + (value.shape[-1],))
    logsumexp = TensorProxy(like=query, shape=(b, h, s_q), dtype=dtypes.float32, requires_grad=False)
    return out, logsumexp


def _backward_meta(grad_out, query, key, value, out, logsumexp, attn_mask, is_causal: bool, scale):
    return TensorProxy(like=query), TensorProxy(like=key), TensorProxy(like=value)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The kernel's mask: added to the scores; a boolean mask (True: attend) becomes 0 / -inf."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask.logical_not(), float("-inf"))


def _last_dim_dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _forward_impl(query, key, value, attn_mask, is_causal, scale):
    q, k, v = map(_last_dim_dense, (query, key, value))
    out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=_additive(attn_mask, q.dtype), scale=scale)
    return out.contiguous(), logsumexp


def _backward_impl(grad_out, query, key, value, out, logsumexp, attn_mask, is_causal, scale):
    q, k, v = map(_last_dim_dense, (query, key, value))
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _last_dim_dense(grad_out), q, k, v, out, logsumexp, 0.0, is_causal,
        attn_mask=_additive(attn_mask, q.dtype), scale=scale)
    return tuple(g.contiguous() for g in grads)


cpu_flash_attention = cpu_attention_ex.register_operator(
    FORWARD_OP, meta=_forward_meta, fn=_forward_impl,
    tags=(OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD,),  # recomputing it would redo the whole attention
)
cpu_flash_attention_backward = cpu_attention_ex.register_operator(BACKWARD_OP, meta=_backward_meta, fn=_backward_impl)


def _execution(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):
    out, _ = cpu_flash_attention(query, key, value, attn_mask, is_causal, scale)
    return out


def _with_grad(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):
    out, logsumexp = cpu_flash_attention(query, key, value, attn_mask, is_causal, scale)
    grads = cpu_flash_attention_backward(get_grad(out), query, key, value, out, logsumexp, attn_mask, is_causal, scale)
    put_grads((query, key, value), grads)
    return out


cpu_attention_ex.register_implementation(
    ltorch.scaled_dot_product_attention, checker=takes, execution_transform=_execution, grad_transform=_with_grad,
)
