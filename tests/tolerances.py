"""How close the parity tests hold a gloo run to its one-process reference, per dtype the two sides round in.

Each gradient is compared parameter by parameter (``max |ours - ref| / max |ref|`` of that parameter alone), so a
wrong gradient of a small bias or norm weight shows; a norm over all of them would let it vanish.

- :data:`FLOAT32`: both sides compute and reduce in float32 (the CPU list, the fused lowering under
  torchcompile, which rounds a little differently: 3.5e-7 measured on the MLP).
- :data:`SAME_CASTS`: mixed precision whose reference makes the same casts through the same decomposed ops and
  reduces in float32 (bfloat16, float16): identical up to the order of a float32 sum (0.0 measured).
- :data:`ULPS_OF_REDUCE`: the reduce itself rounds in a low-precision dtype, where gloo's sum and torch's may
  differ by a rounding: two units in the last place of that dtype, relative to the parameter's largest gradient,
  at the first step (both sides hold the same weights then; later steps drift apart as AdamW turns the
  roundings into different updates, and the losses carry the trajectory).
- :data:`CUDA`: float32 on a GPU, where the fused kernels and the attention kernel round differently.

:data:`PEAK_BYTES`: how far a measured step's peak (torch's profiler, lost frees put back) may lie from
explain()'s prediction read off the traces: the README's "within 1 KiB".
"""

from __future__ import annotations

import torch

FLOAT32 = 1e-5
SAME_CASTS = 1e-6
CUDA = 1e-4
PEAK_BYTES = 1024
_EPSILON = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def ulps_of_reduce(dtype: torch.dtype, ulps: int = 2) -> float:
    """``ulps`` units in the last place of ``dtype`` (its machine epsilon times ``ulps``)."""
    return ulps * _EPSILON[dtype]
