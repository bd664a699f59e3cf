"""How fast a training step runs: tokens per second and, on CUDA, the model FLOPs utilization (MFU).

1. ``model_flops(forward_trace)``: the FLOPs of one training step's micro-batch on one rank, as the usual MFU
   convention counts them: three times the forward's matmuls, linears and attentions (the backward computes
   two matmuls per forward matmul), each counted by :func:`~fsdp_pass.cost.op_flops.estimated_flops`
   (2·m·n·k; attention 4·b·h·s_q·s_k·d, the causal half not taken off), inside fusion regions too. Other ops
   (norms, activations, the loss) are left out, as is the forward that activation checkpointing computes
   again: the count is the model's, not the hardware's.
2. ``peak_flops(device, dtype, given=None)``: the dense matmul peak of one device for the compute dtype: the
   number ``given`` (``--peak-tflops``), else the device's row of :data:`PEAK_TFLOPS` (float32 at the TF32
   rate when ``torch.backends.cuda.matmul.allow_tf32`` is on); None on the CPU or for a device not in the
   table, and the loop then prints no MFU.
3. ``mfu(flops_per_rank, seconds, peak)``: the share of the peak a rank's step reached.
"""

from __future__ import annotations

import torch

from fsdp_pass.cost.op_flops import estimated_flops, is_matmul_like

# dense (no sparsity) matmul peaks in TFLOP/s per device, from the vendors' data sheets:
# (a substring of torch.cuda.get_device_name(), {compute kind: TFLOP/s}); the first match wins
PEAK_TFLOPS = (
    ("H100 PCIe", {"bf16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100 NVL", {"bf16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    ("H100", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM (HBM3)
    ("H200", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.0, "tf32": 183.0, "fp32": 91.6}),
)


def _matmul_flops(bsyms) -> int:
    total = 0
    for bsym in bsyms:
        if bsym.sym.is_fusion:
            total += _matmul_flops(bsym.subsymbols)
        elif is_matmul_like(bsym):
            total += estimated_flops(bsym, skips_masked=False)  # the convention counts every (query, key) pair
    return total


def model_flops(forward_trace) -> int:
    """A training step's FLOPs for one forward call of ``forward_trace`` (and its backward): item 1 above."""
    return 3 * _matmul_flops(forward_trace.bound_symbols)


def _compute_kind(dtype: torch.dtype) -> str:
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"


def peak_flops(device: torch.device, dtype: torch.dtype, given_tflops: float | None = None) -> float | None:
    """FLOP/s one device can reach in matmuls of ``dtype`` (item 2 above), or None where unknown."""
    if given_tflops is not None:
        return given_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for part, peaks in PEAK_TFLOPS:
        if part in name:
            return peaks[_compute_kind(dtype)] * 1e12
    return None


def mfu(flops_per_rank: float, seconds: float, peak: float | None) -> float | None:
    """The share of ``peak`` FLOP/s that ``flops_per_rank`` in ``seconds`` reached, or None without a peak."""
    if peak is None or seconds <= 0:
        return None
    return flops_per_rank / seconds / peak
