"""``FSDP(check_finite=True)``: where in a step a NaN or an inf first appeared, and on which rank.

The pass :mod:`fsdp_pass.passes.insert_finite_checks` puts three ops into the final traces of each compile (the
compile's key names its flags); off, the traces hold none of them:

1. ``clear_finite_flags(key)`` first in the forward: the compile's flags (one int32 per check, on the device the
   checked tensors live on) are zeroed.
2. ``check_finite(tensors, key, slot)`` right after the op that made ``tensors``: flag ``slot`` is set when any of
   them holds a NaN or an inf. ``aminmax`` per tensor (NaN propagates through it, an inf is its min or max; no
   temporary of the tensor's size, no host sync); integer tensors cannot hold either and are skipped.
3. ``raise_if_nonfinite(key)`` last in the backward (last in the forward of a step that has none): the flags come
   to the host, each set flag becomes ``world - rank``, and one all-reduce (MAX) over every rank of the model, on a
   host-side gloo channel, gives every rank the same vector: per check, the lowest rank that saw a NaN or an inf
   (0: none did). Every rank then takes the same decision: if a flag is set anywhere, every rank raises the same
   FSDPError naming the first check in execution order, its unit, what it checked and that rank. No rank is left
   waiting in a collective the others skipped.

The checks of a compile are numbered in execution order: the forward's in trace order, then the backward's (Thunder
finishes the forward trace first). A step whose backward raised returns no gradients: the optimizer step that
follows (if the caller catches the error) finds the gradients of the step before, or none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from thunder.core import prims

from fsdp_pass.errors import fail
from fsdp_pass.op_names import CHECK_FINITE, CLEAR_FINITE_FLAGS, RAISE_IF_NONFINITE
from fsdp_pass.shard.groups import cpu_channel, has_peers

# what a check reads, as the error and the trace's labels name it
PARAMETERS = "parameters"  # forward: this rank's shard of the unit's parameters, as its all-gather sends it
OUTPUT = "output"  # forward: the results of the last op that reads the unit's gathered parameters
GRADIENT = "gradient"  # backward: this rank's unsharded gradient of the unit, as its reduce-scatter reads it
GRADIENT_SHARD = "gradient shard"  # backward: this rank's shard of the reduced gradient

DESCRIPTION = {
    PARAMETERS: "its parameters (this rank's shard, as its all-gather sends it)",
    OUTPUT: "its output (the results of the last op that reads its parameters)",
    GRADIENT: "its gradient (this rank's, before the reduce-scatter)",
    GRADIENT_SHARD: "its gradient shard (after the reduce-scatter)",
}

_TODO = {
    PARAMETERS: (
        "The parameters were finite when the step before checked them, so an optimizer step, a load or your code "
        "wrote the NaN/inf into that rank's shard (or, with a low-precision param_dtype, a float32 value overflows "
        "it): lower the learning rate, clip with fsdp_pass.clip_grad_norm_, check what was loaded."
    ),
    OUTPUT: (
        "The unit's parameters were finite and its output was not: look at that rank's batch (the inputs it fed the "
        "model) and at the unit's computation (a log or division of zero, an overflow in a low-precision dtype)."
    ),
    GRADIENT: (
        "The forward was finite on every rank and this gradient was not: look at the loss that rank computed from "
        "the output (a division by zero tokens, a log of zero), or use a loss scaler with float16."
    ),
    GRADIENT_SHARD: (
        "Every rank's gradient was finite before the reduce-scatter and its sum was not: the sum overflows the "
        "reduce dtype; use MixedPrecision(reduce_dtype=torch.float32)."
    ),
}


@dataclass(frozen=True)
class FiniteCheck:
    """One check of a compile: the unit, what it reads (:data:`PARAMETERS`, ...) and the phase it runs in."""

    unit: str
    what: str
    phase: str

    def describe(self) -> str:
        return f"unit {self.unit!r}, {DESCRIPTION[self.what]}, in the {self.phase}"


@dataclass
class StepFlags:
    """The checks of one compile, in slot order, the ranks that decide together, and the flags of the running step."""

    group: object  # every rank of the model (None or the fake backend: decide alone)
    checks: list[FiniteCheck] = field(default_factory=list)
    values: torch.Tensor | None = None  # int32 per check, allocated by the first check that runs

    def slots(self, device) -> torch.Tensor:
        if self.values is None or self.values.numel() != len(self.checks):
            self.values = torch.zeros(len(self.checks), dtype=torch.int32, device=device)
        return self.values


_STEPS: dict[str, StepFlags] = {}  # compile key -> its flags (every compile this process made with checks)


def add_checks(key: str, group, checks: list[FiniteCheck]) -> int:
    """Give the compile ``key`` the ``checks`` of one phase; returns the first one's slot."""
    step = _STEPS.setdefault(key, StepFlags(group))
    first = len(step.checks)
    step.checks.extend(checks)
    return first


def checks_of(key: str) -> tuple[FiniteCheck, ...]:
    """The checks of compile ``key`` in slot order (empty: none)."""
    step = _STEPS.get(key)
    return () if step is None else tuple(step.checks)


# --- the ops' torch code ---


def clear_finite_flags_impl(key: str) -> None:
    step = _STEPS[key]
    if step.values is not None:
        step.values.zero_()


def _bounds(t: torch.Tensor) -> torch.Tensor:
    low, high = torch.aminmax(t.detach().reshape(-1))
    return torch.stack((low, high)).float()


def check_finite_impl(tensors, key: str, slot: int) -> None:
    floating = [t for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    if not floating:
        return
    bounds = torch.cat([_bounds(t).to(floating[0].device) for t in floating])
    flags = _STEPS[key].slots(floating[0].device)
    flags[slot] = torch.isfinite(bounds).all().logical_not().to(flags.device, non_blocking=True)


def raise_if_nonfinite_impl(key: str) -> None:
    """Step 3: the ranks agree on the flags, then each raises the same error if any is set."""
    step = _STEPS[key]
    group = step.group
    local = step.slots("cpu").cpu()
    peers = has_peers(group)
    world, rank = (dist.get_world_size(group), dist.get_rank(group)) if peers else (1, 0)
    marks = local * (world - rank)  # set flags: world - rank, so that MAX keeps the lowest rank
    if peers:
        dist.all_reduce(marks, op=dist.ReduceOp.MAX, group=cpu_channel(group))
    seen = [(slot, world - int(m)) for slot, m in enumerate(marks.tolist()) if m]
    if not seen:
        return
    slot, first_rank = seen[0]
    if peers:
        first_rank = dist.get_global_rank(group, first_rank)
    elif dist.is_initialized():
        first_rank = dist.get_rank()
    fail(nonfinite_message(step.checks[slot], first_rank, len(seen) - 1), _TODO[step.checks[slot].what])


def nonfinite_message(check: FiniteCheck, rank: int, later: int) -> str:
    """What every rank raises: the first check that saw a NaN or an inf, and how many after it did too."""
    also = f" {later} later check(s) of this step saw one too." if later else ""
    return (
        f"FSDP(check_finite=True): a NaN or an inf in this step, first (in execution order) in {check.describe()}, "
        f"on rank {rank}.{also}"
    )


# --- the ops (bound into the final traces, with their torch code, by the pass) ---


def _no_output(*args) -> None:
    return None


clear_finite_flags = prims.make_prim(
    CLEAR_FINITE_FLAGS, "clear_finite_flags", meta=_no_output, python_impl=clear_finite_flags_impl,
    tags=(prims.OpTags.DONT_DCE,),
)
check_finite = prims.make_prim(
    CHECK_FINITE, "check_finite", meta=_no_output, python_impl=check_finite_impl, tags=(prims.OpTags.DONT_DCE,)
)
raise_if_nonfinite = prims.make_prim(
    RAISE_IF_NONFINITE, "raise_if_nonfinite", meta=_no_output, python_impl=raise_if_nonfinite_impl,
    tags=(prims.OpTags.DONT_DCE,),
)


def bound_clear(key: str, header: str):
    return clear_finite_flags.bind(
        key, output=None, _call_ctx={"clear_finite_flags": clear_finite_flags_impl}
    ).from_bsym(header=header)


def bound_check(tensors, key: str, slot: int, header: str):
    return check_finite.bind(
        list(tensors), key, slot, output=None, _call_ctx={"check_finite": check_finite_impl}
    ).from_bsym(header=header)


def bound_decision(key: str, header: str):
    return raise_if_nonfinite.bind(
        key, output=None, _call_ctx={"raise_if_nonfinite": raise_if_nonfinite_impl}
    ).from_bsym(header=header)
