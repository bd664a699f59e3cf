"""The optimizers the step model prices: what each keeps per parameter and how long its step takes.

``resolve_optimizer(name) -> Optimizer``; names ``"adamw"`` (the default), ``"adam"``, ``"sgd-momentum"``,
``"sgd"``, ``"none"`` (``_`` for ``-`` too).

1. Memory: ``states`` parameter-sized tensors per trainable element, kept between steps beside the shards
   (Adam and AdamW: the two moments; SGD with momentum: its buffer; SGD: none).
2. Time: the cost inputs hold AdamW's step, probed (``CostInputs.optimizer_tensor_s``, per parameter tensor, and
   ``optimizer_bytes_per_s``); another optimizer's is AdamW's times ``tensor_scale`` per tensor and ``byte_scale``
   per byte. The scales were measured on this project's 2-core machine, torch's single-tensor implementations
   (what a CPU runs), one thread, 2026-11-25, 32 tensors of 64 elements and 16 of 256 KiB, the fastest of 7 steps,
   twice: per tensor SGD 2.2 / 2.3 us, SGD with momentum 6.9 / 7.0, Adam 24.2 / 24.5, AdamW 26.4 / 27.9; per byte
   SGD 31 / 32 GB/s, SGD with momentum 5.1 / 5.9, Adam 1.9 / 2.0, AdamW 2.0 (one run; the other was disturbed).
   SGD reads a parameter and its gradient and writes the parameter (12 bytes per float32 element); AdamW reads and
   writes two moments too, and makes temporaries. On a GPU the foreach implementations launch fewer kernels:
   the per-tensor scales are then an estimate, not a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_pass.errors import check


@dataclass(frozen=True)
class Optimizer:
    name: str
    states: int  # parameter-sized state tensors per trainable element
    tensor_scale: float  # its time per parameter tensor, in AdamW's
    byte_scale: float  # its time per byte of parameters, in AdamW's


OPTIMIZERS = {
    "adamw": Optimizer("adamw", 2, 1.0, 1.0),
    "adam": Optimizer("adam", 2, 24.3 / 27.1, 1.0),
    "sgd-momentum": Optimizer("sgd-momentum", 1, 6.9 / 27.1, 2.0 / 5.5),
    "sgd": Optimizer("sgd", 0, 2.2 / 27.1, 2.0 / 31.5),
    "none": Optimizer("none", 0, 0.0, 0.0),
}
ADAMW = OPTIMIZERS["adamw"]


def resolve_optimizer(value) -> Optimizer:
    """``optimizer=``: None (AdamW), a name of :data:`OPTIMIZERS` (``_`` or ``-``), or an :class:`Optimizer`."""
    if value is None:
        return ADAMW
    if isinstance(value, Optimizer):
        return value
    name = str(value).lower().replace("_", "-")
    check(name in OPTIMIZERS, f"Unknown optimizer {value!r} for the step model.",
          f"Pass one of {', '.join(OPTIMIZERS)} (the default: adamw).")
    return OPTIMIZERS[name]
