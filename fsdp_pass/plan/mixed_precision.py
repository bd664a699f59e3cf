"""``MixedPrecision``: which dtype the unit's parameters are gathered and computed in, reduced in, returned in.

The semantics are those of FSDP2's ``MixedPrecisionPolicy`` on the model's root, by construction; where they
differ from FSDP2's recipe (``fully_shard`` on every decoder layer, then on the model), and why, is said below:

- ``param_dtype`` (e.g. ``torch.bfloat16``): Thunder traces the module with its floating parameters in that
  dtype (:mod:`fsdp_pass.shard.module` gives the released originals meta tensors of it), so the module's own
  casts are traced as written: a rotary table computed in float32 and cast to the activations' dtype, an
  RMSNorm that upcasts to float32. Each unit's float32 shard is cast *before* its all-gather (the gather moves
  half the bytes of float32) and the gathered parameters arrive in ``param_dtype``. Buffers stay as the module
  defines them. The optimizer keeps stepping on the float32 shards: they are the master weights.
- ``cast_forward_inputs`` (default True, as FSDP2's): floating tensors among the model's inputs are cast to
  ``param_dtype`` before the compiled step sees them (:mod:`fsdp_pass.shard.forward_inputs`); integer inputs
  (token ids) are left alone. False: inputs reach the model as given. Where this differs from FSDP2's recipe
  (``fully_shard`` on every decoder layer, then on the model): FSDP2 also casts the floating arguments of each
  module it wraps at its call; here only the root's are cast, so a block handed a float32 tensor by the model's
  own code (a residual kept in float32, a float32 table) gets it in float32. In the decoders of Hugging Face and
  of the zoo the blocks are handed ``param_dtype`` hidden states and rotary tables (and boolean masks), so the
  two agree; a model that hands its blocks float32 computes there as its code says.
- ``reduce_dtype`` (default float32): the unit's gradients are cast to it before the reduce-scatter. FSDP2's
  default is None, which here too means the compute dtype (``param_dtype``): a bfloat16 reduce-scatter, half
  the bytes, each sum rounded to 8 bits of mantissa. This default stays float32 because it preserves numerics
  (what changes numerics is opted into); ``MixedPrecision(param_dtype, reduce_dtype=None)``
  is FSDP2's default. Measured on a tiny Llama at world 2 (docs/precision-offload-accumulation.md): a
  bfloat16 reduce moves each gradient by up to 3.6e-3 of its largest element, FSDP2's by 3.8e-3. float16 works as
  well; as a sum of N float16 gradients can overflow, they are divided by the world size before the
  reduce-scatter, not after.
- ``gather_dtype`` (default None: gather in ``param_dtype``), ``torch.int8`` or ``torch.float8_e4m3fn``: each
  unit's packed float32 shard is quantized to one byte per element with a float32 scale per ``gather_block``
  elements (default 128; why blocks for both dtypes, and the buffer's layout: :mod:`fsdp_pass.plan.quantized_layout`),
  codes and scales travel in the unit's one all-gather, and the gathered codes are dequantized into
  ``param_dtype`` (the shards' dtype if None) before the parameters are cut out
  (:mod:`fsdp_pass.ops.quantized_gather`). The gather moves about 0.52x the bytes of a bfloat16 gather (128:
  1 byte + 4/128 of scales per element, against 2: :meth:`MixedPrecision.sent_nbytes`); what the step holds once
  gathered is the dequantized parameters, as many bytes as a ``param_dtype`` gather's
  (:meth:`MixedPrecision.held_nbytes`), and the received codes beside them until they are dequantized. Gradients
  are those of the dequantized parameters, reduced in ``reduce_dtype`` into the float32 master shards as without
  quantization (straight-through: the optimizer steps the unquantized master weights, only what the forward and
  backward compute with is rounded).
  This changes numerics (opt-in): int8 blocks of 128 round each weight to within half a step of
  ``amax/127`` of its block, float8_e4m3fn to 3 mantissa bits; the README's section on 8-bit gathers has the
  measured validation loss against a bfloat16 gather.
- ``output_dtype`` (default: leave the outputs as computed): the model's floating outputs are cast to it at the
  end of the forward (:mod:`fsdp_pass.passes.cast_compute`, the one cast the pass writes into the trace itself).
  FSDP2 casts the outputs of every module it wraps; with one policy for the blocks and the root that would hand
  the root's head float32 activations from the last block (a bfloat16 linear of float32), so the blocks' outputs
  are left as computed: FSDP2 with ``output_dtype`` on the root's policy only.

Numerics: the forward and backward round as the same module run eagerly with its parameters in
``param_dtype`` and float32 master weights (FSDP2 with ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``);
gradients reach the shards in ``reduce_dtype``'s sum, then float32. The parity tests compare against such a
model jitted by plain Thunder, and against FSDP2 (``tests/test_mixed_precision.py``,
``tests/test_recipe_parity.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from thunder.core import dtypes

from fsdp_pass.errors import check
from fsdp_pass.plan.quantized_layout import DEFAULT_BLOCK, QMAX, quantized_nbytes


@dataclass(frozen=True)
class MixedPrecision:
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = torch.float32
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    gather_dtype: torch.dtype | None = None
    gather_block: int = DEFAULT_BLOCK

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, field)
            check(
                value is None or (isinstance(value, torch.dtype) and value.is_floating_point),
                f"MixedPrecision({field}={value!r}): expected a floating torch dtype or None.",
                f"Pass e.g. MixedPrecision({field}=torch.bfloat16), or None to keep the parameters' dtype.",
            )
        check(
            self.gather_dtype is None or self.gather_dtype in QMAX,
            f"MixedPrecision(gather_dtype={self.gather_dtype!r}): a quantized gather takes one of "
            f"{', '.join(map(str, QMAX))}.",
            "Pass gather_dtype=torch.int8 or torch.float8_e4m3fn, or None to gather in param_dtype.",
        )
        check(
            isinstance(self.gather_block, int) and self.gather_block >= 1,
            f"MixedPrecision(gather_block={self.gather_block!r}): expected a positive number of elements per scale.",
            f"Pass e.g. gather_block={DEFAULT_BLOCK} (one float32 scale per {DEFAULT_BLOCK} elements: 3 % more bytes).",
        )

    def gather_args(self) -> tuple:
        """What ``unshard_unit`` takes after its other arguments: (the Thunder dtype of the codes, the block)
        when the gather is quantized, else nothing (the trace of an unquantized gather is unchanged)."""
        return () if self.gather_dtype is None else (thunder_dtype(self.gather_dtype), self.gather_block)

    def sent_nbytes(self, spec) -> int:
        """The bytes of parameter ``spec`` (a :class:`~fsdp_pass.plan.sharding.ParamSpec`) as its unit's gather
        sends them: quantized, one byte per element (padding rows too) and the scales; else in ``param_dtype``
        (a non-floating parameter in its own dtype)."""
        if self.gather_dtype is not None and spec.dtype.is_floating_point:
            return quantized_nbytes(spec.layout, self.gather_block)
        return self.held_nbytes(spec)

    def held_nbytes(self, spec) -> int:
        """The bytes of parameter ``spec`` once gathered, as the step computes with it: in ``param_dtype`` (a
        quantized gather's too: its codes are dequantized into it), a non-floating parameter in its own dtype."""
        return spec.nbytes(self.param_dtype if spec.dtype.is_floating_point else None)

    def describe(self) -> str:
        def name(d, default):
            return default if d is None else str(d).removeprefix("torch.")

        inputs = ""
        if self.param_dtype is not None:
            inputs = f", floating inputs {'cast to it' if self.cast_forward_inputs else 'as given'}"
        gather = f"gather+compute {name(self.param_dtype, 'as stored')}"
        if self.gather_dtype is not None:
            gather = (f"gather {name(self.gather_dtype, '')} (a float32 scale per {self.gather_block} elements), "
                      f"compute {name(self.param_dtype, 'as stored')}")
        return (
            f"{gather}{inputs}, "
            f"reduce {name(self.reduce_dtype, 'as computed')}, outputs {name(self.output_dtype, 'as computed')}"
        )


FULL_PRECISION = MixedPrecision(param_dtype=None, reduce_dtype=None, output_dtype=None)


def traced_dtype(param: torch.Tensor, precision: MixedPrecision) -> torch.dtype:
    """The dtype Thunder traces ``param`` in: ``param_dtype`` for a floating parameter, else its own."""
    if precision.param_dtype is not None and param.is_floating_point():
        return precision.param_dtype
    return param.dtype


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
