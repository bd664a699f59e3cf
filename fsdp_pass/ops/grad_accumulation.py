"""Gradient accumulation without reduce-scatters: the state behind ``no_sync`` and the ops its backward uses.

Inside ``with fsdp_pass.no_sync(jitted_model):`` each backward adds every unit's *unsharded* gradient (the
flat, padded, rank-major buffer the reduce-scatter would have sent, in the reduce dtype) to a per-unit
accumulator on this rank, and issues no collective: the shards get no gradient. The first backward after
the block adds the accumulators to its own gradients, empties them and reduce-scatters once.

1. Each ``FSDP`` transform owns one :class:`GradAccumulators`: whether a ``no_sync`` block is open, and the
   running sums. The step's *mode* is read when the forward runs: ``"accumulate"`` inside ``no_sync``,
   ``"flush"`` outside it while accumulators hold gradients, else ``"reduce"``.
2. Each mode is its own compiled variant. The pass adds :data:`check_grad_sync` to the prologue, so
   Thunder's cache picks the variant compiled for the current mode and compiles a new one on a miss.
3. The backward of the ``"accumulate"`` variant ends each unit with :data:`accumulate_unsharded_grads`; the
   ``"flush"`` variant calls :data:`add_accumulated_grads` right before the reduce-scatter. Both take the
   unit's name and the transform's accumulators.

A guard against the silent mistake: ``optimizer.step()`` while gradients are still in the accumulators
(inside the block, or after it but before a synchronized backward) would step on no gradient and fold
these micro-batches into the next step. While an accumulator holds gradients, an optimizer step pre-hook
raises ``FSDPError`` for any optimizer that holds parameters of this model; it is removed once they are
flushed.

Memory: while accumulating, each rank holds a full unsharded gradient of every trainable parameter (the
padded parameter count times the reduce dtype's bytes), not 1/N of it. ``explain()`` states the figure.
The ops run on the ``fsdp_comm`` executor (:mod:`fsdp_pass_executors.accumulation`).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

from thunder.core import prims
from thunder.core.proxies import TensorProxy
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fsdp_pass.errors import fail

ACCUMULATE, FLUSH, REDUCE = "accumulate", "flush", "reduce"


class GradAccumulators:
    """One FSDP transform's ``no_sync`` state: open blocks, and each unit's running sum of unsharded gradients."""

    def __init__(self):
        self.open_blocks = 0  # no_sync blocks entered and not left (nested blocks keep accumulating)
        self.pending: dict[str, object] = {}  # unit name -> running sum (torch.Tensor)
        self._parameters: dict[int, weakref.ref] = {}  # id -> the model's (sharded) parameters
        self._step_guard = None  # the optimizer step pre-hook's handle while gradients are pending

    def __repr__(self) -> str:
        return f"GradAccumulators(open_blocks={self.open_blocks}, units={sorted(self.pending)})"

    def mode(self) -> str:
        if self.open_blocks:
            return ACCUMULATE
        return FLUSH if self.pending else REDUCE

    def pending_bytes(self) -> int:
        """Bytes held by the accumulators right now."""
        return sum(t.numel() * t.element_size() for t in self.pending.values())

    @contextmanager
    def accumulating(self, parameters):
        """The body of ``no_sync``: backwards of forwards run inside accumulate instead of reducing."""
        self._parameters = {id(p): weakref.ref(p) for p in parameters}
        self.open_blocks += 1
        try:
            yield
        finally:
            self.open_blocks -= 1

    def add(self, unit: str, flat) -> None:
        """``accumulate_unsharded_grads``: add ``flat`` to the unit's running sum."""
        if unit in self.pending:
            self.pending[unit].add_(flat)
        else:
            self.pending[unit] = flat.clone()  # ours: later micro-batches add into it in place
        if self._step_guard is None:
            self._step_guard = register_optimizer_step_pre_hook(_step_guard_of(self))

    def take(self, unit: str, flat):
        """``add_accumulated_grads``: the unit's running sum plus ``flat``; the accumulator is emptied."""
        if unit not in self.pending:
            raise RuntimeError(
                f"fsdp_pass: no gradients were accumulated for unit {unit!r}, but this step was compiled to flush "
                "them. Run every micro-batch of an accumulation through the same model and forward signature."
            )
        total = self.pending.pop(unit).add_(flat)
        if not self.pending and self._step_guard is not None:
            self._step_guard.remove()
            self._step_guard = None
        return total

    def refuse_a_step(self, optimizer) -> None:
        """Raise if ``optimizer`` holds a parameter of this model while gradients are pending."""
        if not self.pending:
            return
        params = self._parameters
        if any(id(p) in params and params[id(p)]() is p for group in optimizer.param_groups for p in group["params"]):
            fail(
                f"optimizer.step() while {len(self.pending)} unit(s) of this model still hold gradients accumulated "
                "under no_sync(): the parameters have no gradient yet, and the step would silently skip these "
                "micro-batches and add them to the next step.",
                "Run the last micro-batch's forward and backward outside no_sync() (it reduce-scatters the "
                "accumulated sum), then call optimizer.step().",
            )


def _step_guard_of(accumulators: GradAccumulators):
    """An optimizer step pre-hook that asks ``accumulators`` (held weakly: the hook keeps nothing alive)."""
    ref = weakref.ref(accumulators)

    def guard(optimizer, args, kwargs) -> None:
        owner = ref()
        if owner is not None:
            owner.refuse_a_step(optimizer)

    return guard


# --- the ops (meta here; implementations in fsdp_pass_executors.accumulation) ---


def _accumulate_meta(flat: TensorProxy, unit: str, accumulators: GradAccumulators) -> None:
    return None


def _add_accumulated_meta(flat: TensorProxy, unit: str, accumulators: GradAccumulators) -> TensorProxy:
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


def accumulate_impl(flat, unit: str, accumulators: GradAccumulators) -> None:
    accumulators.add(unit, flat)


def add_accumulated_impl(flat, unit: str, accumulators: GradAccumulators):
    return accumulators.take(unit, flat)


# --- the prologue check that picks the compiled variant for the current mode ---


def _check_grad_sync_meta(accumulators: GradAccumulators, expected: str) -> None:
    return None


def check_grad_sync_impl(accumulators: GradAccumulators, expected: str) -> None:
    if accumulators.mode() != expected:
        raise AssertionError(f"compiled for gradient sync mode {expected!r}, now {accumulators.mode()!r}")


check_grad_sync = prims.make_prim(
    "fsdp_pass.check_grad_sync",
    "check_grad_sync",
    meta=_check_grad_sync_meta,
    python_impl=check_grad_sync_impl,
    tags=(prims.OpTags.DONT_DCE,),
)


def grad_sync_check(accumulators: GradAccumulators, mode: str):
    """The prologue line ``check_grad_sync(accumulators, mode)``, runnable from the printed prologue."""
    return check_grad_sync.bind(
        accumulators, mode, output=None, _call_ctx={"check_grad_sync": check_grad_sync_impl}
    )
