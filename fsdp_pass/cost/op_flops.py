"""A rough FLOP count of one trace op: enough to tell a matmul-heavy stretch of a trace from an empty one.

Matmuls and linears 2·m·n·k, attention 4·b·h·s_q·s_k·d, any other op one per output element, a fusion region
the sum of what it contains. A causal attention run as one kernel (flash, memory-efficient, cuDNN) skips the
blocks above the diagonal: it computes the s_q·s_k pairs a query sees (query i the keys up to i, top-left
aligned as torch's ``is_causal``), about half; computed op by op (``skips_masked=False``) it computes them all
and masks. The overlap report (what compute hides a collective) and the auto planner (how
long a unit computes) both count with it.
"""

from __future__ import annotations

import math

from fsdp_pass.op_names import CPU_ATTENTION_BACKWARD_OP, CPU_ATTENTION_OP

# attention kernels named by what runs them, not after torch's op: fsdp_pass_executors.cpu_attention's
_ATTENTION_KERNELS = (CPU_ATTENTION_OP, CPU_ATTENTION_BACKWARD_OP)
# where the ops that take ``is_causal`` by position have it: torch's signature, and cpu_attention's two ops
_CAUSAL_AT = {"scaled_dot_product_attention": 5, CPU_ATTENTION_OP: 4, CPU_ATTENTION_BACKWARD_OP: 7}


def numel(proxy) -> int:
    return math.prod(proxy.shape) if getattr(proxy, "shape", None) is not None else 0


def is_matmul_like(bsym) -> bool:
    """A matmul, a linear or an attention: an op the matmul rate times, not the memory rate."""
    name = str(bsym.sym.name)
    return name in ("matmul", "linear") or is_attention(bsym)


def is_attention(bsym) -> bool:
    name = str(bsym.sym.name)
    return "scaled_dot_product" in name or name in _ATTENTION_KERNELS


def is_causal(bsym) -> bool:
    """An attention called with ``is_causal=True`` (by keyword, or by position as torch's signature and
    cpu_attention's ops have it)."""
    if "is_causal" in bsym.kwargs:
        return bool(bsym.kwargs["is_causal"])
    at = _CAUSAL_AT.get(str(bsym.sym.name))
    return at is not None and len(bsym.args) > at and bsym.args[at] is True


def causal_pairs(s_q: int, s_k: int) -> int:
    """(query, key) pairs a causal attention computes: query i sees keys 0..i (top-left aligned)."""
    full = min(s_q, s_k)
    return full * (full + 1) // 2 + max(s_q - s_k, 0) * s_k


def estimated_flops(bsym, skips_masked: bool = True) -> int:
    """The FLOPs of one bound symbol, by the rules above (``skips_masked``: a causal attention runs as a kernel
    that skips what the mask hides)."""
    if bsym.sym.is_fusion:
        return sum(estimated_flops(s, skips_masked) for s in bsym.subsymbols)
    name = str(bsym.sym.name)
    tensors_in = [p for p in bsym.flat_proxy_args if getattr(p, "shape", None) is not None]
    tensors_out = [p for p in bsym.flat_proxy_outs if getattr(p, "shape", None) is not None]
    if not tensors_out:
        return 0
    if name in ("matmul", "linear") and tensors_in and tensors_in[0].shape:
        return 2 * numel(tensors_out[0]) * tensors_in[0].shape[-1]
    if is_attention(bsym) and len(tensors_in) >= 2 and len(tensors_in[0].shape) >= 2:
        # the query and the key: a backward kernel of cpu_attention reads the output's gradient first
        q, k = tensors_in[1:3] if name == CPU_ATTENTION_BACKWARD_OP else tensors_in[:2]
        s_q, s_k = int(q.shape[-2]), int(k.shape[-2])
        pairs = causal_pairs(s_q, s_k) if skips_masked and is_causal(bsym) else s_q * s_k
        return 4 * (numel(q) // max(s_q, 1)) * pairs
    return max(numel(p) for p in tensors_out)
