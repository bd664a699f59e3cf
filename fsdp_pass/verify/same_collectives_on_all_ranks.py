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
3. If the digests differ, the ranks exchange the sequences and their plans, and every rank raises the same
   FSDPError, naming the first collective that differs, and, where the ranks' plans differ, saying so instead of
   blaming the model (:mod:`fsdp_pass.verify.rank_differences`). At most the step's first collective was issued,
   the same on every rank: nothing hangs.
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
    plan: tuple[str, ...] = ()  # the compile's plan (rank_differences.plan_lines): the error says if plans differ
    first: FirstCollective | None = None  # the forward's first collective
    _digest: int | None = None

    def record(self, phase: str, calls: tuple[str, ...]) -> None:
        self.phases[phase] = calls
        self._digest = None

    def described(self) -> dict:
        """What the error compares across ranks (:func:`~fsdp_pass.verify.rank_differences.describe_difference`)."""
        return {**self.phases, "plan": self.plan}

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


def record_step_collectives(key: str, group, phase: str, trace, found: dict, scope: str = "",
                            plan: tuple[str, ...] = ()) -> None:
    """Keep the collectives of one final ``phase`` trace of the compile ``key`` of the model ``scope``, and the
    compile's ``plan`` (:func:`~fsdp_pass.verify.rank_differences.plan_lines`), which the error compares too."""
    step = _STEPS.setdefault(key, StepCollectives(group, scope, plan=plan))
    step.record(phase, collective_calls(trace, found))
    if phase == "forward":
        step.first = _first_collective(trace)


def check_same_collectives_impl(key: str) -> None:
    """Before the forward's first collective (:func:`~fsdp_pass.verify.step_agreement.settle_before_first`)."""
    step = _STEPS[key]
    channel = step_agreement.channel_of(step.group)
    step_agreement.settle_before_first(step.scope, channel, step.digest(), step.first, step.described)


def exchange_step_digest_impl(key: str) -> None:
    """After the first collective's issue (:func:`~fsdp_pass.verify.step_agreement.exchange`)."""
    step = _STEPS[key]
    step_agreement.exchange(step.scope, step_agreement.channel_of(step.group), step.digest())


def await_step_digests_impl(key: str) -> None:
    """Before the second collective (:func:`~fsdp_pass.verify.step_agreement.await_digests`)."""
    step = _STEPS[key]
    step_agreement.await_digests(step.scope, step_agreement.channel_of(step.group), step.described)


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
