"""``Schedule``: when the collectives of a step are issued and waited for (the overlap settings).

    FSDP("zero3", schedule=Schedule(prefetch=1))                 # the default
    FSDP("zero3", schedule=Schedule(prefetch=2, max_unused_bytes=64 << 20))
    FSDP("zero3", schedule=None)                                   # keep Thunder's order

``prefetch`` is how many units ahead a gather is issued: with 1, the gather of the next unit starts when
the current unit's parameters arrive, so it runs while the current unit computes. 0 issues each gather
just before its own wait (nothing to overlap with: the baseline the benchmark compares against).

``prefetch_by_unit`` gives some units a depth of their own (unit name -> depth; the others take ``prefetch``):
a unit's gather is issued right after the wait of the gather that many places before it in the trace's order
of use (in the backward, among the units gathered again). The auto planner sets it, e.g. 0 for a large
unit whose early gather would hold its bytes through the backward of the units before it.

``max_unused_bytes`` bounds the gathered parameters that have been issued but not used yet: a prefetch
that would exceed it is issued later, when enough of the units before it have been used. The unit needed
next is always issued, so it can be exceeded by one unit larger than the bound.

``reduce_scatters_in_flight`` bounds the reduce-scatters issued and not yet waited: each keeps its
full-size gradient buffer alive until its wait. None waits for all of them at the end of the backward.

``kept_units_first``: the units the forward uses first that stay gathered for the backward (all units
under ZeRO-2) are gathered at the top of the forward, all at once: their memory is held until the
backward anyway, so waiting saves nothing; the forward's peak, at its end, holds them either way.

Peak gathered-parameter memory of a ZeRO-3 step is then about (1 + prefetch) units (the unit computing
and the ones in flight), not the whole model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fsdp_pass.errors import check, fail


@dataclass(frozen=True)
class Schedule:
    prefetch: int = 1
    max_unused_bytes: int | None = None
    reduce_scatters_in_flight: int | None = 2
    kept_units_first: bool = True
    prefetch_by_unit: tuple[tuple[str, int], ...] = ()  # (unit name, depth), sorted; a dict is accepted

    def __post_init__(self):
        by_unit = self.prefetch_by_unit
        check(
            isinstance(by_unit, (Mapping, tuple, list)),
            f"Schedule(prefetch_by_unit={by_unit!r}) must map unit names to prefetch depths.",
            "Pass e.g. prefetch_by_unit={'layers.0': 0, 'lm_head': 2} (names as explain() prints them).",
        )
        pairs = tuple(sorted(dict(by_unit).items()))
        for name, depth in pairs:
            check(
                isinstance(name, str) and isinstance(depth, int) and not isinstance(depth, bool) and depth >= 0,
                f"Schedule(prefetch_by_unit=...): {name!r}: {depth!r} is not a unit name and a depth >= 0.",
                "Pass e.g. prefetch_by_unit={'layers.0': 0, 'lm_head': 2} (names as explain() prints them).",
            )
        object.__setattr__(self, "prefetch_by_unit", pairs)
        check(
            isinstance(self.prefetch, int) and self.prefetch >= 0,
            f"Schedule(prefetch={self.prefetch!r}): prefetch must be a whole number of units >= 0.",
            "Use 1 (the default: gather the next unit while this one computes), 2 for deeper prefetch, "
            "or 0 to issue every gather just before its use.",
        )
        check(
            self.max_unused_bytes is None or (isinstance(self.max_unused_bytes, int) and self.max_unused_bytes > 0),
            f"Schedule(max_unused_bytes={self.max_unused_bytes!r}) must be a positive number of bytes or None.",
            "Pass e.g. max_unused_bytes=256 << 20 to keep at most 256 MiB of gathered, not yet used parameters.",
        )
        check(
            self.reduce_scatters_in_flight is None
            or (isinstance(self.reduce_scatters_in_flight, int) and self.reduce_scatters_in_flight >= 1),
            f"Schedule(reduce_scatters_in_flight={self.reduce_scatters_in_flight!r}) must be an int >= 1 or None.",
            "Use 2 (the default), 1 to wait for each before issuing the next, or None to wait at the end.",
        )


    def prefetch_of(self, unit: str | None) -> int:
        """The prefetch depth of the gathers of ``unit`` (None: a gather of no known unit)."""
        return dict(self.prefetch_by_unit).get(unit, self.prefetch)


DEFAULT_SCHEDULE = Schedule()


def resolve_schedule(schedule) -> Schedule | None:
    """``FSDP(schedule=...)``: a Schedule, None (Thunder's order), or an int as the prefetch depth."""
    if schedule is None or isinstance(schedule, Schedule):
        return schedule
    if isinstance(schedule, int) and not isinstance(schedule, bool):
        return Schedule(prefetch=schedule)
    fail(
        f"FSDP(schedule={schedule!r}) is not a schedule.",
        "Pass fsdp_pass.Schedule(prefetch=..., max_unused_bytes=...), an int prefetch depth, or None.",
    )
