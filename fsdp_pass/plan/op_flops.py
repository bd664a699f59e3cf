"""A rough FLOP count of one trace op: enough to tell a matmul-heavy stretch of a trace from an empty one.

Matmuls and linears 2·m·n·k, attention 4·b·h·s_q·s_k·d, any other op one per output element, a fusion region
the sum of what it contains. The overlap report (what compute hides a collective) and the auto planner (how
long a unit computes) both count with it.
"""

from __future__ import annotations

import math


def numel(proxy) -> int:
    return math.prod(proxy.shape) if getattr(proxy, "shape", None) is not None else 0


def is_matmul_like(bsym) -> bool:
    """A matmul, a linear or an attention: an op the matmul rate times, not the memory rate."""
    name = str(bsym.sym.name)
    return name in ("matmul", "linear") or is_attention(bsym)


def is_attention(bsym) -> bool:
    return "scaled_dot_product" in str(bsym.sym.name)


def estimated_flops(bsym) -> int:
    """The FLOPs of one bound symbol, by the rules above."""
    if bsym.sym.is_fusion:
        return sum(estimated_flops(s) for s in bsym.subsymbols)
    name = str(bsym.sym.name)
    tensors_in = [p for p in bsym.flat_proxy_args if getattr(p, "shape", None) is not None]
    tensors_out = [p for p in bsym.flat_proxy_outs if getattr(p, "shape", None) is not None]
    if not tensors_out:
        return 0
    if name in ("matmul", "linear") and tensors_in and tensors_in[0].shape:
        return 2 * numel(tensors_out[0]) * tensors_in[0].shape[-1]
    if is_attention(bsym) and len(tensors_in) >= 2 and len(tensors_in[0].shape) >= 2:
        q, k = tensors_in[0], tensors_in[1]
        return 4 * numel(q) * k.shape[-2]
    return max(numel(p) for p in tensors_out)
