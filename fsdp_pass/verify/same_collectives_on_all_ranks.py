"""Every rank runs the same collectives at every step; where they would not, every rank raises before any mismatched
collective is issued.

Ranks may run different compiled variants of the step: an input of another shape on one rank (a longer
sequence, a smaller last batch) makes Thunder compile another trace there, at that step, on that rank alone.
The parameter collectives do not depend on input shapes, so such variants can run side by side (as under
DDP or FSDP2). What must agree is the sequence of collectives each variant issues: per collective its kind,
its unit, its elements and dtype, in issue order, forward then backward. A model whose branches depend on
the input (a layer used only for long sequences) can break that, at any step.

1. At each compile (stage 6 of :mod:`fsdp_pass.pipeline`), :func:`record_step_collectives` keeps each final
   trace's sequence under the compile's key (and the forward's first collective), and :func:`insert_step_check`
   puts three ops in the forward trace: ``check_same_collectives(key)`` right before its first collective
   (``# [fsdp] check: ...`` above it), ``exchange_step_digest(key)`` right after it, ``await_step_digests(key)``
   right before the second (or before the return, when the forward has one).
2. At every step they compare a 62-bit digest of the variant's sequences across ranks, with one all-reduce of
   two integers on a host-side gloo channel (:func:`fsdp_pass.shard.groups.cpu_channel`: nothing waits for the
   GPU), issued beside the first collective and waited before the second (:mod:`fsdp_pass.verify.step_agreement`
   says why that is enough and why no step can skip it).
3. If the digests differ, the ranks exchange the sequences and every rank raises the same FSDPError, naming
   the first collective that differs. At most the step's first collective was issued, the same on every rank:
   nothing hangs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch.distributed as dist
from thunder.core import prims
from thunder.core.dtypes import to_torch_dtype
from thunder.core.trace import TraceProvenance, from_trace

from fsdp_pass.op_names import AWAIT_STEP_DIGESTS, CHECK_SAME_COLLECTIVES, EXCHANGE_STEP_DIGEST
from fsdp_pass.predicates import collective_kind, is_collective, is_input_unpacking, is_return
from fsdp_pass.verify import step_agreement
from fsdp_pass.verify.step_agreement import FirstCollective


@dataclass
class StepCollectives:
    """The collectives one compiled variant of the step issues, per phase, and the group they run on."""

    group: object
    scope: str = ""  # the model's (every rank names it alike): its steps agree among themselves
    phases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    first: FirstCollective | None = None  # the forward's first collective
    _digest: int | None = None

    def record(self, phase: str, calls: tuple[str, ...]) -> None:
        self.phases[phase] = calls
        self._digest = None

    def digest(self) -> int:
        if self._digest is None:
            text = repr(sorted(self.phases.items())).encode()
            self._digest = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 2
        return self._digest


_STEPS: dict[str, StepCollectives] = {}  # compile key -> its collectives (every variant this process compiled)


def collective_calls(trace, found: dict | None = None) -> tuple[str, ...]:
    """Each collective of ``trace`` in order, as ``"all-gather of unit 'layers.0': 1,024 x float32"``; ``found``:
    output name -> (Unit, kind), from :func:`~fsdp_pass.passes.units_of_collectives.units_of_collectives` (None:
    no unit names)."""
    found = found or {}
    out = []
    for b in trace.bound_symbols:
        kind = collective_kind(b)
        if kind is None:
            continue
        t = b.flat_proxy_args[0]
        unit = found.get(b.output.name, (None,))[0]
        of = f" of unit {unit.name!r}" if unit is not None else ""
        out.append(f"{kind}{of}: {t.numel:,} x {str(t.dtype).removeprefix('thunder.dtypes.')}")
    return tuple(out)


def _first_collective(trace) -> FirstCollective | None:
    b = next((b for b in trace.bound_symbols if is_collective(b)), None)
    if b is None:
        return None
    t = b.flat_proxy_args[0]
    group = next(a for a in b.args if isinstance(a, dist.ProcessGroup))
    return FirstCollective(collective_kind(b), t.numel, to_torch_dtype(t.dtype), t.device.device_str(), group)


def record_step_collectives(key: str, group, phase: str, trace, found: dict, scope: str = "") -> None:
    """Keep the collectives of one final ``phase`` trace of the compile ``key`` of the model ``scope``."""
    step = _STEPS.setdefault(key, StepCollectives(group, scope))
    step.record(phase, collective_calls(trace, found))
    if phase == "forward":
        step.first = _first_collective(trace)


def _first_difference(ref: dict, other: dict, rank: int) -> str | None:
    """Where the sequences of rank 0 (``ref``) and ``rank`` first differ, forward first."""
    for phase in ("forward", "backward"):
        a, b = ref.get(phase, ()), other.get(phase, ())
        for i in range(max(len(a), len(b))):
            ca = a[i] if i < len(a) else "nothing"
            cb = b[i] if i < len(b) else "nothing"
            if ca != cb:
                return f"  first difference, {phase} collective #{i}: rank 0 {ca}; rank {rank} {cb}"
    return None


def _counts(sequences: dict) -> str:
    return " + ".join(str(len(sequences.get(phase, ()))) for phase in ("forward", "backward"))


def describe_difference(prints: list[dict]) -> str | None:
    """None when every rank's sequences (``{phase: [collective, ...]}``) agree, else where the first two differ."""
    ref = prints[0]
    for rank, other in enumerate(prints[1:], start=1):
        if other == ref:
            continue
        lines = [
            (
                f"rank 0 and rank {rank} are about to run steps that issue different collectives (their inputs "
                "may differ in shape, but not in the collectives the step issues)."
            ),
            _first_difference(ref, other, rank),
            f"  collectives (forward + backward): rank 0 {_counts(ref)}, rank {rank} {_counts(other)}",
        ]
        return "\n".join(line for line in lines if line is not None)
    return None


DIFFERENT_TODO = (
    "Make every rank's step issue the same collectives whatever its input: use the same modules in the same order "
    "on every rank (no branch on the input's shape or values that skips or adds a layer), and enter no_sync() and "
    "torch.no_grad() on every rank alike."
)


def check_same_collectives_impl(key: str) -> None:
    """Before the forward's first collective (:func:`~fsdp_pass.verify.step_agreement.settle_before_first`)."""
    step = _STEPS[key]
    channel = step_agreement.channel_of(step.group)
    step_agreement.settle_before_first(step.scope, channel, step.digest(), step.first, lambda: step.phases)


def exchange_step_digest_impl(key: str) -> None:
    """After the first collective's issue (:func:`~fsdp_pass.verify.step_agreement.exchange`)."""
    step = _STEPS[key]
    step_agreement.exchange(step.scope, step_agreement.channel_of(step.group), step.digest())


def await_step_digests_impl(key: str) -> None:
    """Before the second collective (:func:`~fsdp_pass.verify.step_agreement.await_digests`)."""
    step = _STEPS[key]
    step_agreement.await_digests(step.scope, step_agreement.channel_of(step.group), lambda: step.phases)


def _no_output(key: str) -> None:
    return None


def _prim(op_id: str, name: str, impl):
    return prims.make_prim(op_id, name, meta=_no_output, python_impl=impl, tags=(prims.OpTags.DONT_DCE,))


check_same_collectives = _prim(CHECK_SAME_COLLECTIVES, "check_same_collectives", check_same_collectives_impl)
exchange_step_digest = _prim(EXCHANGE_STEP_DIGEST, "exchange_step_digest", exchange_step_digest_impl)
await_step_digests = _prim(AWAIT_STEP_DIGESTS, "await_step_digests", await_step_digests_impl)

_HEADER = (
    "[fsdp] check: every rank runs a step with these collectives (a digest of the forward's and the backward's, "
    "one all-reduce on a host-side gloo channel, issued beside the first collective and awaited before the "
    "second); else every rank raises, naming the first that differs"
)


def _op(symbol, impl, key: str, header: str | None = None):
    bsym = symbol.bind(key, output=None, _call_ctx={symbol.name: impl})
    return bsym.from_bsym(header=header) if header else bsym


def insert_step_check(trace, key: str):
    """``trace`` with the step's agreement ops: ``check_same_collectives(key)`` right before its first collective,
    ``exchange_step_digest(key)`` right after it, ``await_step_digests(key)`` right before its second collective
    (or its return). A forward with no collective: the check alone, after the inputs are unpacked."""
    bsyms = list(trace.bound_symbols)
    check = _op(check_same_collectives, check_same_collectives_impl, key, _HEADER)
    collectives = [i for i, b in enumerate(bsyms) if is_collective(b)]
    if not collectives:
        at = next((i for i, b in enumerate(bsyms) if not is_input_unpacking(b)), len(bsyms))
        bsyms.insert(at, check)
    else:
        first = collectives[0]
        second = collectives[1] if len(collectives) > 1 else next(
            (i for i, b in enumerate(bsyms) if is_return(b)), len(bsyms)
        )
        bsyms = [
            *bsyms[:first],
            check,
            bsyms[first],
            _op(exchange_step_digest, exchange_step_digest_impl, key),
            *bsyms[first + 1 : second],
            _op(await_step_digests, await_step_digests_impl, key),
            *bsyms[second:],
        ]
    new = from_trace(trace)
    new.bound_symbols = bsyms
    new.set_provenance(TraceProvenance("fsdp_pass: check that every rank runs the same collectives"))
    return new
