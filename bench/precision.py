"""The dtype policy of a :mod:`bench.gpu` run: what the parameters are kept in, computed in and reduced in.

``Precision.of(dtype, recipe) -> Precision``, one of three policies:

1. ``float32``: the model in float32, every row the same (no casts).
2. ``bfloat16`` (``--dtype bfloat16``): the whole model cast to bfloat16 before any system wraps it; no float32
   master weights, the optimizer steps in bfloat16.
3. ``recipe`` (``--recipe``): the users' recipe. Parameters stay float32 (the master weights the optimizer steps
   on), computed in bfloat16, gradients reduced in float32: ours with
   ``FSDP(mixed_precision=MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32))``, FSDP2 with
   ``fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))``. The
   rows without FSDP (eager, compile, thunder) have no such policy; they run their forward and loss under
   ``torch.autocast(device, torch.bfloat16)`` with float32 parameters (:meth:`Precision.autocast`), which casts
   per op (matmuls in bfloat16, norms and reductions as autocast lists them) rather than per parameter, so their
   loss differs from the FSDP rows' by more than rounding.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_pass.plan.mixed_precision import MixedPrecision

AUTOCAST_ROWS = ("eager", "compile", "thunder")  # bench.gpu's rows without FSDP: autocast in the recipe
RECIPE_NOTE = ("eager, compile, thunder (no FSDP, so no mixed-precision policy): forward and loss under "
               "torch.autocast(bfloat16), parameters float32")


@dataclass(frozen=True)
class Precision:
    name: str  # "float32", "bfloat16" or "recipe"

    @staticmethod
    def of(dtype: str, recipe: bool) -> Precision:
        """``--dtype`` and ``--recipe`` as a policy (``--recipe`` keeps ``--dtype`` at float32: it sets the master
        weights' dtype itself)."""
        return Precision("recipe" if recipe else dtype)

    @property
    def is_recipe(self) -> bool:
        return self.name == "recipe"

    @property
    def model_dtype(self) -> torch.dtype:
        """The dtype the model's parameters are cast to before a system wraps it (the optimizer's dtype)."""
        return torch.bfloat16 if self.name == "bfloat16" else torch.float32

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the matmuls run in (what the probe measures)."""
        return torch.float32 if self.name == "float32" else torch.bfloat16

    def fsdp2_policy(self) -> MixedPrecisionPolicy:
        """FSDP2's ``mp_policy``: the recipe's casts, or none (FSDP2's default policy keeps the parameters' dtype)."""
        if self.is_recipe:
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    def ours(self) -> MixedPrecision | None:
        """Our ``FSDP(mixed_precision=...)``: the recipe's casts, or None."""
        return MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32) if self.is_recipe else None

    def autocast(self, device: torch.device):
        """What the rows without FSDP run their forward and loss under: bfloat16 autocast in the recipe, else
        nothing."""
        if self.is_recipe:
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def describe(self) -> str:
        """One line for the table's header."""
        if self.name == "float32":
            return "float32 (parameters, compute, gradients, optimizer)"
        if self.name == "bfloat16":
            return "bfloat16: the whole model cast to bfloat16, no float32 master weights"
        return ("recipe: float32 master weights, bfloat16 compute, float32 reduce (ours "
                "MixedPrecision(bfloat16, reduce_dtype=float32); fsdp2 MixedPrecisionPolicy(param_dtype=bfloat16, "
                "reduce_dtype=float32))")
