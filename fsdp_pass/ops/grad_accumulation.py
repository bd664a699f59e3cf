"""Gradient accumulation without reduce-scatters: :func:`no_sync` and the two ops its backward uses.

Inside ``with no_sync(jitted_model):`` each backward adds every unit's *unsharded* gradient (the flat,
padded, rank-major buffer the reduce-scatter would have sent, in the reduce dtype) to a per-unit
accumulator on this rank, and issues no collective: the shards get no gradient. The first backward
after the block adds the accumulators to its own gradients, empties them and reduce-scatters once.

1. The step's *mode* is read when the forward runs: ``"accumulate"`` inside ``no_sync``, ``"flush"`` outside it
   while accumulators hold gradients, else ``"reduce"``.
2. Each mode is its own compiled variant. The pass adds :data:`check_grad_sync` to the prologue, so
   Thunder's cache picks the variant compiled for the current mode and compiles a new one on a miss.
3. The backward of the ``"accumulate"`` variant ends each unit with :data:`accumulate_unsharded_grads`; the
   ``"flush"`` variant calls :data:`add_accumulated_grads` right before the reduce-scatter.

A guard against the silent mistake: ``optimizer.step()`` while gradients are still in the accumulators
(inside the block, or after it but before a synchronized backward) would step on no gradient and fold
these micro-batches into the next step. A global optimizer step pre-hook raises ``FSDPError`` instead,
for any optimizer that holds parameters of a model with pending accumulators.

Memory: while accumulating, each rank holds a full unsharded gradient of every trainable parameter (the
padded parameter count times the reduce dtype's bytes), not 1/N of it. ``explain()`` states the figure.
The ops run on the ``fsdp_comm`` executor (:mod:`fsdp_pass_executors.accumulation`).
"""

from __future__ import annotations

import itertools
import weakref
from contextlib import contextmanager

from thunder.core import prims
from thunder.core.proxies import TensorProxy
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fsdp_pass.errors import fail

ACCUMULATE, FLUSH, REDUCE = "accumulate", "flush", "reduce"

_syncing: dict[str, bool] = {}  # FSDP key -> False inside no_sync
_pending: dict[str, dict[str, object]] = {}  # FSDP key -> accumulator key -> running sum (torch.Tensor)
_parameters: dict[str, dict[int, weakref.ref]] = {}  # FSDP key -> id -> the model's (sharded) parameters
_keys = itertools.count()


def new_key() -> str:
    """A key for one FSDP transform's accumulators."""
    key = f"fsdp{next(_keys)}"
    _syncing[key] = True
    _pending[key] = {}
    return key


def mode_of(key: str) -> str:
    if not _syncing[key]:
        return ACCUMULATE
    return FLUSH if _pending[key] else REDUCE


def pending_bytes(key: str) -> int:
    """Bytes held by the accumulators of one FSDP transform right now."""
    return sum(t.numel() * t.element_size() for t in _pending[key].values())


@contextmanager
def no_sync(jitted):
    """Accumulate gradients locally (no reduce-scatter) for the backwards of forwards run in this block.

    The first forward+backward after the block reduce-scatters the sum of everything accumulated.
    """
    from fsdp_pass.transform import fsdp_of

    key = fsdp_of(jitted).accumulation_key
    _parameters[key] = {id(p): weakref.ref(p) for p in jitted.parameters()}
    outer, _syncing[key] = _syncing[key], False
    try:
        yield
    finally:
        _syncing[key] = outer  # nested blocks: the outer one still accumulates


def _refuse_a_step_while_accumulating(optimizer, args, kwargs) -> None:
    for key, params in _parameters.items():
        if not _pending[key]:
            continue
        if any(id(p) in params and params[id(p)]() is p for group in optimizer.param_groups for p in group["params"]):
            n = len(_pending[key])
            fail(
                f"optimizer.step() while {n} unit(s) of this model still hold gradients accumulated under "
                "no_sync(): the parameters have no gradient yet, and the step would silently skip these "
                "micro-batches and add them to the next step.",
                "Run the last micro-batch's forward and backward outside no_sync() (it reduce-scatters the "
                "accumulated sum), then call optimizer.step().",
            )


register_optimizer_step_pre_hook(_refuse_a_step_while_accumulating)


def accumulator_key(fsdp_key: str, unit_name: str) -> str:
    return f"{fsdp_key}/{unit_name}"


def _fsdp_key_of(accumulator: str) -> str:
    return accumulator.split("/", 1)[0]


# --- the ops (meta here; implementations in fsdp_pass_executors.accumulation) ---


def _accumulate_meta(flat: TensorProxy, key: str) -> None:
    return None


def _add_accumulated_meta(flat: TensorProxy, key: str) -> TensorProxy:
    return TensorProxy(like=flat)


accumulate_unsharded_grads = prims.make_prim(
    "fsdp_pass.accumulate_unsharded_grads",
    "accumulate_unsharded_grads",
    meta=_accumulate_meta,
    tags=(prims.OpTags.DONT_DCE,),  # its effect is the accumulator, not an output
)

add_accumulated_grads = prims.make_prim(
    "fsdp_pass.add_accumulated_grads", "add_accumulated_grads", meta=_add_accumulated_meta
)


def accumulate_impl(flat, key: str) -> None:
    pending = _pending[_fsdp_key_of(key)]
    if key in pending:
        pending[key].add_(flat)
    else:
        pending[key] = flat.clone()  # ours: later micro-batches add into it in place


def add_accumulated_impl(flat, key: str):
    pending = _pending[_fsdp_key_of(key)]
    if key not in pending:
        raise RuntimeError(
            f"fsdp_pass: no gradients were accumulated for {key!r}, but this step was compiled to flush them. "
            "Run every micro-batch of an accumulation through the same model and forward signature."
        )
    return pending.pop(key).add_(flat)


# --- the prologue check that picks the compiled variant for the current mode ---


def _check_grad_sync_meta(fsdp_key: str, expected: str) -> None:
    return None


def check_grad_sync_impl(fsdp_key: str, expected: str) -> None:
    if mode_of(fsdp_key) != expected:
        raise AssertionError(f"compiled for gradient sync mode {expected!r}, now {mode_of(fsdp_key)!r}")


check_grad_sync = prims.make_prim(
    "fsdp_pass.check_grad_sync",
    "check_grad_sync",
    meta=_check_grad_sync_meta,
    python_impl=check_grad_sync_impl,
    tags=(prims.OpTags.DONT_DCE,),
)


def grad_sync_check(fsdp_key: str, mode: str):
    """The prologue line ``check_grad_sync(fsdp_key, mode)``, runnable from the printed prologue."""
    return check_grad_sync.bind(fsdp_key, mode, output=None, _call_ctx={"check_grad_sync": check_grad_sync_impl})
