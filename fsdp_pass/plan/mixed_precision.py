"""``MixedPrecision``: which dtype the unit's parameters are gathered and computed in, reduced in, returned in.

- ``param_dtype`` (e.g. ``torch.bfloat16``): each unit's shard is cast *before* its all-gather (so the
  gather moves half the bytes of float32) and the forward computes in it. Floating inputs and buffers
  are cast to it too, as FSDP2's ``cast_forward_inputs`` does, so no op mixes the two dtypes.
  The optimizer keeps stepping on the float32 shards: they are the master weights.
- ``reduce_dtype`` (default float32): the unit's gradients are cast to it before the reduce-scatter.
  bfloat16 halves those bytes too, at the cost of summing in bfloat16. float16 works as well; as a sum
  of N float16 gradients can overflow, they are divided by the world size before the reduce-scatter,
  not after.
- ``output_dtype`` (default: leave the outputs as computed): floating outputs are cast to it.

Numerics: with ``param_dtype=bfloat16`` the forward and backward round like a model cast with
``.to(torch.bfloat16)``; gradients reach the shards in float32. The parity tests compare against such a
model jitted by plain Thunder (``tests/test_mixed_precision.py``): identical with a float32 reduce (tolerance
1e-6), within 2e-2 with a bfloat16 reduce, whose sum gloo rounds differently from torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from thunder.core import dtypes

from fsdp_pass.errors import check


@dataclass(frozen=True)
class MixedPrecision:
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = torch.float32
    output_dtype: torch.dtype | None = None

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, field)
            check(
                value is None or (isinstance(value, torch.dtype) and value.is_floating_point),
                f"MixedPrecision({field}={value!r}): expected a floating torch dtype or None.",
                f"Pass e.g. MixedPrecision({field}=torch.bfloat16), or None to keep the parameters' dtype.",
            )

    def describe(self) -> str:
        def name(d, default):
            return default if d is None else str(d).removeprefix("torch.")

        return (
            f"gather+compute {name(self.param_dtype, 'as stored')}, reduce {name(self.reduce_dtype, 'as computed')}, "
            f"outputs {name(self.output_dtype, 'as computed')}"
        )


FULL_PRECISION = MixedPrecision(param_dtype=None, reduce_dtype=None, output_dtype=None)


def resolve_mixed_precision(spec) -> MixedPrecision:
    """``None`` -> no casts; a :class:`MixedPrecision`; a bare dtype -> gather and compute in it."""
    if spec is None:
        return FULL_PRECISION
    if isinstance(spec, torch.dtype):
        return MixedPrecision(param_dtype=spec)
    check(
        isinstance(spec, MixedPrecision),
        f"mixed_precision={spec!r} is neither None, a dtype nor a MixedPrecision.",
        "Pass e.g. mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32).",
    )
    return spec


def thunder_dtype(d: torch.dtype | None):
    """The Thunder dtype the trace ops take (None stays None)."""
    return None if d is None else dtypes.to_dtype(d)
