"""The ``cpu_attention`` executor (``fsdp_pass_executors.cpu_attention``): attention on torch's CPU flash kernel.

1. Its forward output and q / k / v gradients, float32 and bfloat16, causal (what Hugging Face Llama's ``sdpa``
   attention passes without padding: no mask, ``is_causal=True``, its own ``scale``), with Hugging Face's additive
   mask (``(b, 1, s, s)`` in the model's dtype, ``finfo.min`` where a query must not look: padding) and with a
   boolean one. Tolerances, all relative to the largest element of each tensor:
   - against eager torch: ``assert_close``'s defaults for the dtype; eager runs the same kernel on the CPU
     (0.0 apart measured);
   - against a float64 reference: at most 3x the decomposition's own error (the path it replaces) plus one
     unit in the last place. Measured (s 32, d 16): float32 both 2e-7 .. 8e-7; bfloat16 the kernel 3e-3 .. 1.7e-2,
     the decomposition 5e-3 .. 1.8e-2 (the kernel rounds the probabilities less often, but its backward reads
     the bfloat16 output: k's causal gradient 1.65e-2 against 7.7e-3, 2.1x).
2. It keeps for the backward no tensor of ``b·h·s·s`` elements (the decomposition keeps its probabilities).
3. It declines what the kernel does not compute as the decomposition does (dropout, float64, a value head size
   other than the query's, a 3-D mask, a mask that needs a gradient): those attentions stay decomposed.
"""

from __future__ import annotations

import math

import pytest
import thunder
import torch
from fsdp_pass.cost.op_flops import causal_pairs, estimated_flops, is_attention, is_causal
from fsdp_pass_executors.cpu_attention import BACKWARD_OP, FORWARD_OP, cpu_attention_ex
from thunder.extend import get_executor

B, H, S, D, SCALE = 2, 4, 32, 16, 0.25
_EPSILON = {torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


def attention(q, k, v, mask, causal, dropout=0.0):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                            is_causal=causal, scale=SCALE)


def _keep() -> torch.Tensor:
    """Causal, and sequence 1 padded: its last 5 keys hidden from every query, its first 5 queries see only
    themselves (every row sees a key, as Hugging Face's sdpa masks ensure)."""
    keep = torch.ones(S, S).tril().bool().expand(B, 1, S, S).clone()
    keep[1, :, :, -5:] = False
    keep[1, :, :5, :] = torch.eye(5, S).bool()
    return keep


def _mask(kind: str, dtype):
    if kind == "causal":
        return None
    keep = _keep()
    if kind == "boolean":
        return keep
    return torch.zeros(B, 1, S, S, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)


def _run(exs, inputs, grad_out, dtype, mask, causal):
    """(output, q grad, k grad, v grad) in float64, and the jitted function (None: eager)."""
    qkv = [x.to(dtype).requires_grad_() for x in inputs]
    fn = attention if exs is None else thunder.jit(attention, executors=exs)
    out = fn(*qkv, mask, causal)
    out.backward(grad_out.to(dtype))
    return [out.detach().double(), *(x.grad.double() for x in qkv)], (None if exs is None else fn)


def _reference(inputs, grad_out, mask, causal):
    qkv = [x.clone().requires_grad_() for x in inputs]
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, -math.inf)
    elif mask is not None:
        mask = mask.double()
    out = torch.ops.aten._scaled_dot_product_attention_math(*qkv, mask, 0.0, causal, scale=SCALE)[0]
    out.backward(grad_out)
    return [out.detach(), *(x.grad for x in qkv)]


def _ops(jfn) -> set[str]:
    return {str(b.sym.name) for b in thunder.last_traces(jfn)[-1].bound_symbols}


def _relative(x, ref) -> float:
    return ((x - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["causal", "additive", "boolean"])
def test_outputs_and_gradients_match_eager_and_the_decomposition(dtype, kind):
    torch.manual_seed(0)
    inputs = [torch.randn(B, H, S, D, dtype=torch.float64) * 2 for _ in range(3)]
    grad_out = torch.randn(B, H, S, D, dtype=torch.float64)
    mask, causal = _mask(kind, dtype), kind == "causal"
    ours, jours = _run([cpu_attention_ex, get_executor("torch")], inputs, grad_out, dtype, mask, causal)
    decomposed, jdec = _run([get_executor("torch")], inputs, grad_out, dtype, mask, causal)
    eager, _ = _run(None, inputs, grad_out, dtype, mask, causal)
    ref = _reference(inputs, grad_out, mask, causal)
    assert FORWARD_OP in _ops(jours) and FORWARD_OP not in _ops(jdec)
    for name, o, d, e, r in zip(("out", "grad q", "grad k", "grad v"), ours, decomposed, eager, ref):
        torch.testing.assert_close(o.to(dtype), e.to(dtype), msg=lambda m: f"{name} vs eager: {m}")
        assert _relative(o, r) <= 3 * _relative(d, r) + _EPSILON[dtype], (name, _relative(o, r), _relative(d, r))


def test_keeps_no_probabilities_for_the_backward():
    q, k, v = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(3))
    saved = {}
    for name, exs in (("ours", [cpu_attention_ex, get_executor("torch")]), ("decomposed", [get_executor("torch")])):
        jfn = thunder.jit(attention, executors=exs)
        jfn(q, k, v, None, True)
        _, (tensors, _) = thunder.last_traces(jfn)[-1].output
        saved[name] = max(math.prod(t.shape) for t in tensors)
    assert saved == {"ours": B * H * S * D, "decomposed": B * H * S * S}


@pytest.mark.parametrize("case", ["dropout", "float64", "value head size", "3-D mask", "mask with a gradient"])
def test_declines_what_the_kernel_does_not_compute_alike(case):
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    mask, dropout = None, 0.0
    if case == "float64":
        q, k, v = q.double(), k.double(), v.double()
    elif case == "value head size":
        v = torch.randn(B, H, S, 2 * D)
    elif case == "3-D mask":
        mask = torch.zeros(1, S, S)
    elif case == "mask with a gradient":
        mask = torch.zeros(B, 1, S, S, requires_grad=True)
    else:
        dropout = 0.1
    jfn = thunder.jit(attention, executors=[cpu_attention_ex, get_executor("torch")])
    jfn(q, k, v, mask, False, dropout)
    assert FORWARD_OP not in _ops(jfn)


def test_the_flop_count_reads_its_two_ops_as_the_attention_they_run():
    """The overlap report and the loop's model FLOPs (``op_flops.estimated_flops``) count cpu_attention's forward and
    backward ops as an attention: 4·b·h·s_q·s_k·d, less the half a causal kernel skips where asked (``is_causal``
    read by its position in each op)."""
    q, k, v = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(3))
    jfn = thunder.jit(attention, executors=[cpu_attention_ex, get_executor("torch")])
    jfn(q, k, v, None, True).sum().backward()
    traces = thunder.last_traces(jfn)[-1], thunder.last_backward_traces(jfn)[-1]
    ops = [b for t in traces for b in t.bound_symbols if str(b.sym.name) in (FORWARD_OP, BACKWARD_OP)]
    assert [str(b.sym.name) for b in ops] == [FORWARD_OP, BACKWARD_OP]
    for b in ops:
        assert is_attention(b) and is_causal(b)
        assert estimated_flops(b, skips_masked=False) == 4 * B * H * S * S * D
        assert estimated_flops(b) == 4 * B * H * causal_pairs(S, S) * D
