"""Every rank runs the same collectives at every step; where they would not, every rank raises before any is issued.

Ranks may run different compiled variants of the step: an input of another shape on one rank (a longer
sequence, a smaller last batch) makes Thunder compile another trace there, at that step, on that rank alone.
The parameter collectives do not depend on input shapes, so such variants can run side by side (as under
DDP or FSDP2). What must agree is the sequence of collectives each variant issues: per collective its kind,
its unit, its elements and dtype, in issue order, forward then backward. A model whose branches depend on
the input (a layer used only for long sequences) can break that, at any step.

1. At each compile (stage 6 of :mod:`fsdp_pass.pipeline`), :func:`record_step_collectives` keeps each final
   trace's sequence under the compile's key, and :func:`insert_step_check` starts the forward trace with
   ``check_same_collectives(key)``, before any collective (``# [fsdp] check: ...`` above it).
2. At every step that op reduces the variant's sequences to a 62-bit digest, and the ranks compare digests
   with one all-reduce of two integers on a host-side gloo channel (:func:`fsdp_pass.shard.groups.cpu_channel`):
   nothing waits for the GPU.
3. If the digests differ, the ranks exchange the sequences and every rank raises the same FSDPError, naming
   the first collective that differs. No collective of the step has been issued yet: nothing hangs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from thunder.core import prims
from thunder.core.trace import TraceProvenance, from_trace

from fsdp_pass.errors import fail
from fsdp_pass.op_names import CHECK_SAME_COLLECTIVES
from fsdp_pass.predicates import collective_kind, is_input_unpacking
from fsdp_pass.shard.groups import cpu_channel


@dataclass
class StepCollectives:
    """The collectives one compiled variant of the step issues, per phase, and the group they run on."""

    group: object
    phases: dict[str, tuple[str, ...]] = field(default_factory=dict)
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


def record_step_collectives(key: str, group, phase: str, trace, found: dict) -> None:
    """Keep the collectives of one final ``phase`` trace of the compile ``key``."""
    _STEPS.setdefault(key, StepCollectives(group)).record(phase, collective_calls(trace, found))


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
    """The op's body: compare this variant's digest across ranks; on a difference, raise on every rank."""
    step = _STEPS[key]
    channel = cpu_channel(step.group)
    d = step.digest()
    both = torch.tensor([d, -d], dtype=torch.int64)
    try:
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=channel)
        if int(both[0]) == -int(both[1]):
            return
        prints: list = [None] * dist.get_world_size(channel)
        dist.all_gather_object(prints, step.phases, group=channel)
    except (RuntimeError, dist.DistError) as e:
        fail(
            f"Another rank did not come to this step's collective check ({type(e).__name__}: {e}). A rank stopped "
            "(its process ended or raised: see its own error), or is running something else (a collective helper "
            "such as full_state_dict() that this rank did not call).",
            "Look at the other ranks' errors first; every rank must run the same steps and helpers in the same order.",
        )
    fail(describe_difference(prints) or "the ranks' collective digests differ", DIFFERENT_TODO)


def _check_same_collectives_meta(key: str) -> None:
    return None


check_same_collectives = prims.make_prim(
    CHECK_SAME_COLLECTIVES,
    "check_same_collectives",
    meta=_check_same_collectives_meta,
    python_impl=check_same_collectives_impl,
    tags=(prims.OpTags.DONT_DCE,),
)

_HEADER = (
    "[fsdp] check: every rank runs a step with these collectives (a digest of the forward's and the backward's, "
    "one all-reduce on a host-side gloo channel); else every rank raises, naming the first that differs"
)


def insert_step_check(trace, key: str):
    """``trace`` with ``check_same_collectives(key)`` before its first line that is not unpacking the inputs."""
    bsyms = trace.bound_symbols
    at = next((i for i, b in enumerate(bsyms) if not is_input_unpacking(b)), len(bsyms))
    op = check_same_collectives.bind(
        key, output=None, _call_ctx={"check_same_collectives": check_same_collectives_impl}
    ).from_bsym(header=_HEADER)
    new = from_trace(trace)
    new.bound_symbols = [*bsyms[:at], op, *bsyms[at:]]
    new.set_provenance(TraceProvenance("fsdp_pass: check that every rank runs the same collectives"))
    return new
