"""Activation checkpointing levels, per unit: what a unit keeps of its forward for the backward, and what it
recomputes there instead.

- ``none``: every result the backward needs is kept.
- ``selective``: the results of its matmuls and attentions are kept (the expensive ops); the cheap ones between
  them (norms, activation functions, residual adds, casts) are recomputed in the backward from them.
- ``full``: only what leaves the unit is kept; the whole unit is recomputed in the backward, from the gather the
  backward does anyway (:mod:`fsdp_pass.passes.checkpoint_units`).

``checkpoint_level(value)`` reads what a user (or the auto plan) gives for one unit: a bool (True: ``full``) or
a level's name.
"""

from __future__ import annotations

from fsdp_pass.errors import check

NONE, SELECTIVE, FULL = "none", "selective", "full"
LEVELS = (NONE, SELECTIVE, FULL)


def checkpoint_level(value) -> str:
    """``value`` (a bool, None, or a level's name) as a level."""
    if value is None or value is False:
        return NONE
    if value is True:
        return FULL
    check(
        isinstance(value, str) and value.lower() in LEVELS,
        f"{value!r} is not an activation checkpointing level.",
        f"Pass True (full), False, or one of {', '.join(repr(lv) for lv in LEVELS)}.",
    )
    return value.lower()
