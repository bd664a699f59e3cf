"""What the error says when the ranks' steps would issue different collectives, and whose doing it is.

Each rank's step is described by its collectives, per phase (``"forward"``, ``"backward"``: one line per collective,
:func:`~fsdp_pass.verify.same_collectives_on_all_ranks.collective_calls`), and by its plan (``"plan"``:
:func:`plan_lines`, its units with their resharding and checkpointing, and the schedule). ``describe_difference``
compares rank 0's with every other rank's and gives ``(message, what to do)`` for the first that differs:

- the plans are the same: the steps' collectives differ because the model's forward does (it uses other modules for
  other inputs, or a rank is in ``no_sync()``/``torch.no_grad()`` alone): the user's to fix;
- the plans differ: every rank plans once, from the step all ranks agree on (:mod:`fsdp_pass.search.planned_from`),
  so they should not; the message says so and names the first unit that differs, rather than blame the model.
"""

from __future__ import annotations

PHASES = ("forward", "backward")

DIFFERENT_TODO = (
    "Make every rank's step issue the same collectives whatever its input: use the same modules in the same order "
    "on every rank (no branch on the input's shape or values that skips or adds a layer), and enter no_sync() and "
    "torch.no_grad() on every rank alike."
)
PLANS_TODO = (
    "This is not your model's doing: please report it with both ranks' explain() output. Until it is fixed, pin "
    "the plan by hand, the same on every rank: units='blocks' (or your own units) and reshard_after_forward=True "
    "(ZeRO-3) instead of FSDP('auto') or the default units."
)


def plan_lines(plan, options) -> tuple[str, ...]:
    """A rank's plan as lines to compare: per unit its parameters, resharding and checkpointing; the schedule."""
    lines = [f"unit {u.name!r}: {len(u.params)} parameter(s), {'reshards' if u.reshard_after_forward else 'kept'} "
             f"after forward, checkpoint {u.checkpoint}" for u in plan.units]
    return (*lines, f"schedule {options.schedule!r}")


def _first_difference(ref: dict, other: dict, rank: int) -> str | None:
    """Where the sequences of rank 0 (``ref``) and ``rank`` first differ, forward first."""
    for phase in PHASES:
        a, b = ref.get(phase, ()), other.get(phase, ())
        for i in range(max(len(a), len(b))):
            ca = a[i] if i < len(a) else "nothing"
            cb = b[i] if i < len(b) else "nothing"
            if ca != cb:
                return f"  first difference, {phase} collective #{i}: rank 0 {ca}; rank {rank} {cb}"
    return None


def _first_plan_difference(ref: tuple, other: tuple, rank: int) -> str:
    i = next((i for i, (a, b) in enumerate(zip(ref, other)) if a != b), min(len(ref), len(other)))
    a = ref[i] if i < len(ref) else "nothing"
    b = other[i] if i < len(other) else "nothing"
    return f"  first difference of the plans: rank 0 {a}; rank {rank} {b}"


def _counts(sequences: dict) -> str:
    return " + ".join(str(len(sequences.get(phase, ()))) for phase in PHASES)


def describe_difference(prints: list[dict]) -> tuple[str, str] | None:
    """None when every rank's step (``{phase: [collective, ...], "plan": plan_lines}``) agrees, else what the error
    says of the first that differs from rank 0's, and what to do."""
    ref = prints[0]
    for rank, other in enumerate(prints[1:], start=1):
        if other == ref:
            continue
        counts = f"  collectives (forward + backward): rank 0 {_counts(ref)}, rank {rank} {_counts(other)}"
        collective = _first_difference(ref, other, rank)
        if ref.get("plan", ()) != other.get("plan", ()):
            head = (f"rank 0 and rank {rank} planned differently, so their steps would issue different collectives: "
                    "fsdp_pass plans once, at the model's first compile, from a step every rank agrees on, so the "
                    "plans should be the same (this is not your model's doing).")
            lines = [head, _first_plan_difference(ref.get("plan", ()), other.get("plan", ()), rank), collective, counts]
            return "\n".join(line for line in lines if line is not None), PLANS_TODO
        head = (f"rank 0 and rank {rank} are about to run steps that issue different collectives (their inputs may "
                "differ in shape, but not in the collectives the step issues).")
        return "\n".join(line for line in (head, collective, counts) if line is not None), DIFFERENT_TODO
    return None
