"""``FSDP(check_finite=True)``: where in a step a NaN or an inf first appeared: the parameter (its module and unit),
the rank, the phase and which check saw it.

The pass :mod:`fsdp_pass.passes.insert_finite_checks` puts three ops into the final traces of each compile (the
compile's key names its flags); off, the traces hold none of them:

1. ``clear_finite_flags(key)`` first in the forward: the compile's flags (int32, on the device the checked tensors
   live on) are zeroed.
2. ``check_finite(tensors, key, slot, cut)`` right after the op that made ``tensors``: one flag per part of them,
   set when the part holds a NaN or an inf. ``cut`` says what a part is: each parameter's segment of a unit's flat
   buffer (:data:`SEGMENTS`, the packed shard; :data:`COLUMNS`, the packed gradients, rank-major), each tensor
   (:data:`EACH`: gradient shards, the parameters viewed from their shards), or None: all of them, one flag (a
   region's output). So a unit holding the whole model still names the parameter. On a GPU, ``aminmax`` per part
   (NaN propagates through it, an inf is its min or max; no temporary of the tensor's size, no host sync), the
   flags written on the device; on the CPU, where reading a result costs the host nothing, a flat buffer is read
   whole first (one ``aminmax``) and cut into its parameters only when it is not finite. Integer tensors cannot
   hold a NaN or an inf and are skipped. A buffer that another stream fills (an offloaded shard's
   host-to-device copy runs on the communication stream:
   :data:`~fsdp_pass.ops.flat_buffers.WRITTEN_ON`) is checked on that stream, after the copy and before the
   all-gather the executor issues there next (that stream first waits for the compute stream, where the flags
   were zeroed); the verdict waits for that stream. The check's label in the trace says it reads the copy.
3. ``raise_if_nonfinite(key, phase)`` last in the forward and last in the backward: that phase's flags come to the
   host, each set flag becomes ``world - rank``, and one all-reduce (MAX) over every rank of the model, on a
   host-side gloo channel, gives every rank the same vector: per flag, the lowest rank that saw a NaN or an inf (0:
   none did). Every rank then takes the same decision: if a flag is set anywhere, every rank raises the same
   :class:`NonFiniteError` naming the first check in execution order, the first part of it that was not finite
   (the parameter, or the region whose output it was), what it checked and that rank. No rank is left waiting in a
   collective the others skipped. The forward decides at its end whether or not a backward follows, so a forward
   whose result is never differentiated (an evaluation under ``torch.no_grad``, or with gradients on and no
   ``backward()``) reports too; a NaN in the forward is reported before the backward runs.

With a loss scaler (an enabled :class:`fsdp_pass.GradScaler` on the model, :func:`scaler_handles_gradients`), the
backward's checks (the gradients before and after the reduce-scatter) raise nothing: an inf or a NaN there is the
overflow the scaler finds in the gradient shards, skips the step for and backs off from. The forward's checks still
raise: the loss scale does not reach the forward, so a non-finite parameter or output recurs at every scale.

The checks of a compile are numbered in execution order: the forward's in trace order, then the backward's (Thunder
finishes the forward trace first). A step whose backward raised returns no gradients: the optimizer step that
follows (if the caller catches the error) finds the gradients of the step before, or none.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from thunder.core import prims

from fsdp_pass.errors import FSDPError
from fsdp_pass.op_names import CHECK_FINITE, CLEAR_FINITE_FLAGS, RAISE_IF_NONFINITE
from fsdp_pass.ops.flat_buffers import WRITTEN_ON
from fsdp_pass.ranks import has_peers
from fsdp_pass.shard.groups import cpu_channel

# what a check reads, as the error and the trace's labels name it
PARAMETERS = "parameters"  # forward: this rank's shard of the unit's parameters, as its all-gather sends it
OUTPUT = "output"  # forward: what a region (a block, or a unit) computed and the ops after it read
GRADIENT = "gradient"  # backward: this rank's unsharded gradient of the unit, as its reduce-scatter reads it
GRADIENT_SHARD = "gradient shard"  # backward: this rank's shard of the reduced gradient
BACKWARD_CHECKS = (GRADIENT, GRADIENT_SHARD)

DESCRIPTION = {
    PARAMETERS: "its parameters (this rank's shard, as its all-gather sends it)",
    OUTPUT: "its output (what its ops computed and the ops after it read, after its last op)",
    GRADIENT: "its gradient (this rank's, before the reduce-scatter)",
    GRADIENT_SHARD: "its gradient shard (after the reduce-scatter)",
}
# what one part of a check is, in the error
_OF_PART = {
    PARAMETERS: "this rank's shard, as its all-gather sends it",
    GRADIENT: "its gradient on this rank, before the reduce-scatter",
    GRADIENT_SHARD: "its gradient shard, after the reduce-scatter",
}

# how a check's tensors are cut into parts, one flag each (the ``cut`` argument of ``check_finite``)
SEGMENTS = "segments"  # (SEGMENTS, sizes): one flat tensor, consecutive segments of these sizes
COLUMNS = "columns"  # (COLUMNS, rows, sizes): one flat tensor viewed as (rows, sum(sizes)), column blocks
EACH = "each"  # (EACH,): each tensor is a part

_TODO = {
    PARAMETERS: (
        "The parameters were finite when the step before checked them, so an optimizer step, a load or your code "
        "wrote the NaN/inf into that rank's shard (or, with a low-precision param_dtype, a float32 value overflows "
        "it): lower the learning rate, clip with fsdp_pass.clip_grad_norm_, check what was loaded."
    ),
    OUTPUT: (
        "The parameters it read were finite and its output was not: look at that rank's batch (the inputs it fed "
        "the model) and at that computation (a log or division of zero, an overflow in a low-precision dtype)."
    ),
    GRADIENT: (
        "The forward was finite on every rank and this gradient was not: look at the loss that rank computed from "
        "the output (a division by zero tokens, a log of zero), or with float16 use fsdp_pass.GradScaler (the "
        "gradient checks then leave an overflow to it)."
    ),
    GRADIENT_SHARD: (
        "Every rank's gradient was finite before the reduce-scatter and its sum was not: the sum overflows the "
        "reduce dtype; use MixedPrecision(reduce_dtype=torch.float32)."
    ),
}


@dataclass(frozen=True)
class FiniteCheck:
    """One check of a compile: the unit, what it reads (:data:`PARAMETERS`, ...), the phase it runs in, and its
    parts, one flag each: the parameters of a buffer in its order (their names), or ``()``: one flag for all it
    reads. ``region``: for an output, the block or unit whose ops computed it."""

    unit: str
    what: str
    phase: str
    parts: tuple[str, ...] = ()
    region: str = ""

    @property
    def flags(self) -> int:
        return max(1, len(self.parts))

    def describe(self) -> str:
        if self.what == OUTPUT and self.region and self.region != self.unit:
            return f"the output of {self.region!r} (in unit {self.unit!r}), in the {self.phase}"
        return f"unit {self.unit!r}, {DESCRIPTION[self.what]}, in the {self.phase}"

    def describe_part(self, part: int) -> str:
        """What flag ``part`` of this check saw: the parameter, its module and unit, and what was read of it."""
        if not self.parts:
            return self.describe()
        name = self.parts[part]
        module = name.rpartition(".")[0]
        where = f"module {module!r}, unit {self.unit!r}" if module else f"unit {self.unit!r}"
        return f"parameter {name!r} ({where}): {_OF_PART[self.what]}, in the {self.phase}"


class NonFiniteError(FSDPError):
    """What every rank raises when a check saw a NaN or an inf: ``check`` (a :class:`FiniteCheck`), ``parameter``
    (the first non-finite one of that check, or None for an output), ``rank`` (the lowest that saw it), ``phase``."""

    def __init__(self, message: str, check: FiniteCheck, parameter: str | None, rank: int):
        super().__init__(message)
        self.check, self.parameter, self.rank, self.phase = check, parameter, rank, check.phase


@dataclass
class StepFlags:
    """The checks of one compile, in slot order, the ranks that decide together, and the flags of the running step."""

    group: object  # every rank of the model (None or the fake backend: decide alone)
    scope: str = ""  # the model's (what a loss scaler registers with)
    checks: list[FiniteCheck] = field(default_factory=list)
    owner: list[tuple[int, int]] = field(default_factory=list)  # per flag: (its check's index, its part)
    values: torch.Tensor | None = None  # int32 per flag, allocated by the first check that runs
    streams: set = field(default_factory=set)  # side streams a check of this step wrote its flags on
    ranges: dict = field(default_factory=dict)  # phase -> range_of(phase), worked out once

    def slots(self, device) -> torch.Tensor:
        if self.values is None or self.values.numel() != len(self.owner):
            self.values = torch.zeros(len(self.owner), dtype=torch.int32, device=device)
        return self.values

    def range_of(self, phase: str) -> tuple[int, int]:
        """The flags of ``phase``'s checks: ``[first, end)`` (a phase's checks are added together, in order)."""
        if phase not in self.ranges:
            mine = [i for i, (c, _) in enumerate(self.owner) if self.checks[c].phase == phase]
            self.ranges[phase] = (mine[0], mine[-1] + 1) if mine else (0, 0)
        return self.ranges[phase]


_STEPS: dict[str, StepFlags] = {}  # compile key -> its flags (every compile this process made with checks)
_SCALED: set[str] = set()  # scopes of the models whose gradients an enabled loss scaler handles


def add_checks(key: str, group, checks: list[FiniteCheck], scope: str = "") -> list[int]:
    """Give the compile ``key`` the ``checks`` of one phase; returns each one's first flag."""
    step = _STEPS.setdefault(key, StepFlags(group, scope))
    step.ranges.clear()
    firsts = []
    for check in checks:
        firsts.append(len(step.owner))
        step.owner.extend((len(step.checks), part) for part in range(check.flags))
        step.checks.append(check)
    return firsts


def checks_of(key: str) -> tuple[FiniteCheck, ...]:
    """The checks of compile ``key`` in execution order (empty: none)."""
    step = _STEPS.get(key)
    return () if step is None else tuple(step.checks)


def flag_owners(key: str) -> tuple[tuple[int, int], ...]:
    """Per flag of compile ``key``: (the index of its check in :func:`checks_of`, its part)."""
    step = _STEPS.get(key)
    return () if step is None else tuple(step.owner)


def scaler_handles_gradients(scope: str, handles: bool = True) -> None:
    """An enabled loss scaler on the model of ``scope`` handles its gradients' overflow: the backward's checks raise
    nothing (the module's docstring). Called by :class:`fsdp_pass.GradScaler` on every rank."""
    (_SCALED.add if handles else _SCALED.discard)(scope)


# --- the ops' torch code ---


def clear_finite_flags_impl(key: str) -> None:
    step = _STEPS[key]
    if step.values is not None:
        step.values.zero_()
    step.streams.clear()


def _parts(tensors, cut) -> list[list]:
    """``tensors`` cut into the parts that get one flag each."""
    if cut is None:
        return [list(tensors)]
    if cut[0] == EACH:
        return [[t] for t in tensors]
    (flat,) = tensors
    if cut[0] == SEGMENTS:
        return [[p] for p in flat.split(list(cut[1]))]
    rows, sizes = cut[1], cut[2]
    return [[p] for p in flat.view(rows, -1).split(list(sizes), dim=1)]


def _checked(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0


def _on_stream(stream):
    """Run what follows on ``stream`` (None: where the caller runs)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def _writer_stream(tensors):
    return next((getattr(t, WRITTEN_ON) for t in tensors if hasattr(t, WRITTEN_ON)), None)


def _finite_on_host(tensors) -> bool:
    """Whether every one of ``tensors`` (CPU tensors: reading a result costs the host nothing) is finite."""
    for t in tensors:
        low, high = torch.aminmax(t.detach())
        if not (math.isfinite(low.item()) and math.isfinite(high.item())):
            return False
    return True


def _check_on_host(tensors, parts, flags, slot: int, cut) -> None:
    """The CPU's check: a unit's flat buffer whole first (one ``aminmax``, as one flag would cost), cut into its
    parameters only when it is not finite."""
    if cut is not None and cut[0] != EACH and _finite_on_host([t for t in tensors if _checked(t)]):
        flags[slot : slot + len(parts)] = 0
        return
    for i, part in enumerate(parts):
        flags[slot + i] = not _finite_on_host([t for t in part if _checked(t)])


def check_finite_impl(tensors, key: str, slot: int, cut=None) -> None:
    parts = _parts(tensors, cut)
    items = [(i, t) for i, part in enumerate(parts) for t in part if _checked(t)]
    if not items:
        return
    step, stream = _STEPS[key], _writer_stream(tensors)
    flags = step.slots(items[0][1].device)
    if not flags.is_cuda and stream is None:
        _check_on_host(tensors, parts, flags, slot, cut)
        return
    dtype = items[0][1].dtype
    for _, t in items[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    if stream is not None and flags.is_cuda:  # the flags were zeroed (or made) on the compute stream
        stream.wait_stream(torch.cuda.current_stream(flags.device))
    with _on_stream(stream):  # a device's check: no host sync, one flag per part written on the device
        bounds = torch.stack([torch.stack(torch.aminmax(t.detach())).to(dtype) for _, t in items])
        bad = torch.isfinite(bounds).all(dim=1).logical_not()
        if cut is None:
            flags[slot] = bad.any()
        elif len(items) == len(parts):
            flags[slot : slot + len(parts)] = bad
        else:  # some parts hold nothing to check (an integer tensor, no elements)
            flags[[slot + i for i, _ in items]] = bad
        for _, t in items:
            if stream is not None and t.is_cuda:  # read on a stream the allocator did not give it to
                t.record_stream(stream)
    if stream is not None:
        step.streams.add(stream)


def _agreed_marks(step: StepFlags, first: int, end: int) -> tuple[list[int], int, bool]:
    """(per flag of ``[first, end)``: 0, or world - the lowest rank that set it; the world size; whether peers)."""
    values = step.slots("cpu")
    if values.is_cuda:
        for stream in step.streams:  # checks that ran on a side stream (offloaded shards)
            torch.cuda.current_stream(values.device).wait_stream(stream)
    local = values[first:end].cpu()
    group = step.group
    peers = has_peers(group)
    world, rank = (dist.get_world_size(group), dist.get_rank(group)) if peers else (1, 0)
    marks = local * (world - rank)  # set flags: world - rank, so that MAX keeps the lowest rank
    if peers:
        dist.all_reduce(marks, op=dist.ReduceOp.MAX, group=cpu_channel(group))
    return marks.tolist(), world, peers


def raise_if_nonfinite_impl(key: str, phase: str = "backward") -> None:
    """Step 3: the ranks agree on ``phase``'s flags, then each raises the same error if any is set."""
    step = _STEPS[key]
    if phase == "backward" and step.scope in _SCALED:  # the gradients' overflow: the scaler's business
        return
    first, end = step.range_of(phase)
    if end == first:
        return
    marks, world, peers = _agreed_marks(step, first, end)
    seen = [(first + i, world - m) for i, m in enumerate(marks) if m]
    if not seen:
        return
    slot, first_rank = seen[0]
    if peers:
        first_rank = dist.get_global_rank(step.group, first_rank)
    elif dist.is_initialized():
        first_rank = dist.get_rank()
    check_index, part = step.owner[slot]
    check = step.checks[check_index]
    also = [step.owner[s][1] for s, _ in seen[1:] if step.owner[s][0] == check_index]
    later = len({step.owner[s][0] for s, _ in seen}) - 1
    message = nonfinite_message(check, part, first_rank, [check.parts[p] for p in also if check.parts], later)
    raise NonFiniteError(
        f"{message}\n  What to do: {_TODO[check.what]}", check, check.parts[part] if check.parts else None, first_rank
    )


def nonfinite_message(check: FiniteCheck, part: int, rank: int, also: list[str], later: int) -> str:
    """What every rank raises: the first check and part that saw a NaN or an inf, the other parameters of that
    check that did too, and how many checks after it did."""
    others = ""
    if also:
        named = ", ".join(repr(n) for n in also[:3])
        others = f" Also not finite there: {named}" + (f" and {len(also) - 3} more." if len(also) > 3 else ".")
    tail = f" {later} later check(s) of this step saw one too." if later else ""
    return (
        f"FSDP(check_finite=True): a NaN or an inf in this step, first (in execution order) in "
        f"{check.describe_part(part)}, on rank {rank}.{others}{tail}"
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


def bound_check(tensors, key: str, slot: int, cut, header: str):
    return check_finite.bind(
        list(tensors), key, slot, cut, output=None, _call_ctx={"check_finite": check_finite_impl}
    ).from_bsym(header=header)


def bound_decision(key: str, phase: str, header: str):
    return raise_if_nonfinite.bind(
        key, phase, output=None, _call_ctx={"raise_if_nonfinite": raise_if_nonfinite_impl}
    ).from_bsym(header=header)
