"""``CompiledStep``: one compile of a training step under FSDP, frozen: what the reports read.

The transform keeps the latest one (``FSDP.compiled_step``); the functional path returns the same pieces.
Report code (:mod:`fsdp_pass.report`) takes a ``CompiledStep`` as an argument and reads nothing else of the
transform.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from fsdp_pass.plan.options import FSDPOptions
from fsdp_pass.plan.units import UnitPlan

PHASES = ("forward", "backward")

_compiles = itertools.count(1)


def new_step_key() -> str:
    """A name for one compile, unique in this process (the per-step check finds its collectives by it)."""
    return f"step-{next(_compiles)}"


@dataclass(frozen=True)
class CompiledStep:
    plan: UnitPlan  # the units of this compile, from its forward trace
    options: FSDPOptions  # what the passes were asked to do
    forward: object | None = None  # the final (executable) forward trace; None until lowered
    backward: object | None = None  # the final backward trace; None when nothing requires grad
    unit_of_collective: dict[str, str] = field(default_factory=dict)  # collective output name -> unit name
    # the traces as Thunder lowered them, before stages 5-7 (schedule, verify, label): another schedule can be
    # tried on them without compiling again (fsdp_pass.pipeline.reschedule)
    lowered: dict[str, object] = field(default_factory=dict)
    key: str = field(default_factory=new_step_key)

    def with_final_trace(self, phase: str, trace, unit_of_collective: dict[str, str], lowered=None) -> CompiledStep:
        """This step with its final ``phase`` trace (``"forward"`` or ``"backward"``), the units found in it, and
        the ``lowered`` trace it was made from."""
        assert phase in PHASES, phase
        return replace(
            self,
            **{phase: trace},
            unit_of_collective={**self.unit_of_collective, **unit_of_collective},
            lowered={**self.lowered, phase: lowered} if lowered is not None else self.lowered,
        )

    def final_trace(self, phase: str):
        return self.forward if phase == "forward" else self.backward
