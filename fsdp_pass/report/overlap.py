"""What compute hides each collective: a static overlap report read off the final traces.

``overlap_report(forward, backward, units=None) -> OverlapReport``

For every all-gather, reduce-scatter and all-reduce:

1. where it is issued and where it is waited for (positions in its trace);
2. the compute ops between the two, by name, and an estimate of their FLOPs (matmuls 2·m·n·k, attention
   4·b·h·s·s·d, other ops one per output element, fusion regions the sum of what they contain);
3. ``exposed``: nothing computes between issue and wait, so the collective's whole time is waited for
   (the first gather of a step always is: nothing is ready to compute before it). The ops that take
   another collective's result apart (cutting parameters out of a gathered buffer, dividing a reduced
   gradient shard by the world size) do not count as compute here.

``units`` (collective output name -> unit name, as a :class:`~fsdp_pass.compiled_step.CompiledStep` holds
them; ``step_overlap(step)`` passes them) names the unit of each row; without it, rows are named by kind
and position only, so the report also reads traces this pass did not make (Thunder's own FSDP).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from fsdp_pass.compiled_step import CompiledStep
from fsdp_pass.op_names import CollectiveKind
from fsdp_pass.passes.collective_groups import graph, unpacking_group
from fsdp_pass.cost.op_flops import estimated_flops, numel
from fsdp_pass.predicates import (
    collective_kind,
    is_all_gather,
    is_bookkeeping,
    is_collective,
    is_unit_op,
    is_view_like,
    is_wait,
)
from fsdp_pass.text import format_table, human_bytes


def is_compute(bsym) -> bool:
    """An op that does the model's work on the device: not bookkeeping, not a view, not communication, not one
    of the pass's ops that pack, unpack or accumulate a unit's buffer."""
    return not (is_bookkeeping(bsym) or is_view_like(bsym) or is_collective(bsym) or is_wait(bsym) or is_unit_op(bsym))


@dataclass(frozen=True)
class CollectiveOverlap:
    phase: str
    kind: CollectiveKind
    unit: str | None
    full_bytes: int
    issued_at: int
    waited_at: int
    ops_between: tuple[tuple[str, int], ...]  # (op name, count), most frequent first
    flops_between: int

    @property
    def exposed(self) -> bool:
        return self.flops_between == 0

    @property
    def compute_ops_between(self) -> int:
        return sum(n for _, n in self.ops_between)


def collective_overlaps(trace, phase: str, units: dict[str, str] | None = None) -> list[CollectiveOverlap]:
    bsyms = trace.bound_symbols
    wait_at = {b.args[0].name: i for i, b in enumerate(bsyms) if is_wait(b)}
    _, consumers = graph(bsyms)
    # what takes a collective's result apart (cuts, the division of a reduced shard) hides nothing
    unpacking = {j for w in wait_at.values() for j in unpacking_group(w, bsyms, consumers)[0]}
    rows = []
    for i, b in enumerate(bsyms):
        if not is_collective(b):
            continue
        w = wait_at.get(b.output.name, len(bsyms))
        between = [x for j, x in enumerate(bsyms[i + 1 : w], i + 1) if j not in unpacking and is_compute(x)]
        full = b.output if is_all_gather(b) else b.flat_proxy_args[0]
        rows.append(
            CollectiveOverlap(
                phase,
                collective_kind(b),
                (units or {}).get(b.output.name),
                numel(full) * full.dtype.bytes,
                i,
                w,
                tuple(Counter(str(x.sym.name) for x in between).most_common()),
                sum(estimated_flops(x) for x in between),
            )
        )
    return rows


@dataclass(frozen=True)
class OverlapReport:
    rows: tuple[CollectiveOverlap, ...]

    def exposed(self) -> list[CollectiveOverlap]:
        return [r for r in self.rows if r.exposed]

    def __str__(self) -> str:
        header = ("phase", "collective", "unit", "bytes", "issue..wait", "compute between", "~MFLOP", "exposed?")
        lines = []
        for r in self.rows:
            ops = ", ".join(f"{name} x{n}" for name, n in r.ops_between[:3])
            more = len(r.ops_between) - 3
            ops = f"{r.compute_ops_between} ops ({ops}{', ...' if more > 0 else ''})" if r.ops_between else "none"
            lines.append(
                (
                    r.phase,
                    r.kind,
                    r.unit or "?",
                    human_bytes(r.full_bytes),
                    f"{r.issued_at}..{r.waited_at}",
                    ops,
                    f"{r.flops_between / 1e6:.3g}",
                    "EXPOSED" if r.exposed else "",
                )
            )
        out = format_table(header, lines)
        n_exposed = len(self.exposed())
        out.append(f"{len(self.rows)} collectives, {n_exposed} exposed (no compute between issue and wait)")
        return "\n".join(out)


def overlap_report(forward, backward=None, units: dict[str, str] | None = None) -> OverlapReport:
    rows = collective_overlaps(forward, "forward", units)
    if backward is not None:
        rows += collective_overlaps(backward, "backward", units)
    return OverlapReport(tuple(rows))


def step_overlap(step: CompiledStep) -> OverlapReport:
    """The report of one compiled step, each row named with its unit."""
    return overlap_report(step.forward, step.backward, step.unit_of_collective)
