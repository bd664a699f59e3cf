"""What a step communicates and how much unsharded parameter memory it holds, read off the final traces.

``step_stats(forward, backward, world_size) -> StepStats`` works on any Thunder forward/backward pair
that uses Thunder's distributed prims (this pass's traces, and Thunder's own FSDP's):

1. every all-gather, reduce-scatter and all-reduce, with the size of its full (unsharded) buffer;
2. bytes each rank sends per step, in the ring model over the group each collective runs on (N ranks): an
   all-gather or reduce-scatter of a full buffer of S bytes costs (N-1)/N * S per rank, an all-reduce twice
   that; with HSDP, split by group: the shard group's gathers and reduce-scatters (within a node, as meshes are
   usually laid out) and the replicate group's all-reduces (across nodes);
3. peak gathered-parameter bytes (:func:`fsdp_pass.report.memory.live_over_step`): a gathered buffer is live
   from its all-gather's issue to the last use of anything cut out of it (views, reshapes, slices).
   What the forward saves for the backward stays live until the backward's last use of it.

The floor that ZeRO cannot beat (P parameters of b bytes, N ranks): ZeRO-2 sends 2(N-1)/N*P*b per rank and
step (one gather, one reduce-scatter of everything), ZeRO-3 3(N-1)/N*P*b (everything gathered twice).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_pass.op_names import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, CollectiveKind
from fsdp_pass.predicates import collective_group, collective_kind
from fsdp_pass.report.memory import live_over_step, tensor_bytes


@dataclass(frozen=True)
class Collective:
    phase: str  # "forward" or "backward"
    kind: CollectiveKind
    position: int  # index in its trace
    full_bytes: int  # the unsharded buffer: gathered output, or reduce-scatter / all-reduce input
    group_size: int  # the ranks of the group it runs on

    @property
    def bytes_per_rank(self) -> float:
        """Ring model: what each rank sends for it."""
        n = self.group_size
        return self.full_bytes * (n - 1) / n * (2 if self.kind is ALL_REDUCE else 1)


def collectives_of(trace, phase: str) -> list[Collective]:
    out = []
    for i, b in enumerate(trace.bound_symbols):
        kind = collective_kind(b)
        if kind is not None:  # the full buffer: what an all-gather returns, what the others read
            full = b.output if kind is ALL_GATHER else b.flat_proxy_args[0]
            out.append(Collective(phase, kind, i, tensor_bytes(full), collective_group(b).size()))
    return out


@dataclass(frozen=True)
class StepStats:
    world_size: int
    collectives: tuple[Collective, ...]
    peak_gathered_bytes: int

    def count(self, kind: CollectiveKind | None = None, phase: str | None = None) -> int:
        return sum(1 for c in self.collectives if kind in (None, c.kind) and phase in (None, c.phase))

    @property
    def bytes_per_rank(self) -> float:
        return sum(c.bytes_per_rank for c in self.collectives)

    @property
    def replicate_bytes_per_rank(self) -> float:
        """HSDP: what each rank sends over the replicate group (the gradient shards' all-reduces)."""
        return sum(c.bytes_per_rank for c in self.collectives if c.kind is ALL_REDUCE)

    def breakdown(self) -> str:
        """e.g. ``'6 AG (4 fwd + 2 bwd) + 4 RS'``."""
        ag_f, ag_b = self.count(ALL_GATHER, "forward"), self.count(ALL_GATHER, "backward")
        parts = [f"{ag_f + ag_b} AG ({ag_f} fwd + {ag_b} bwd)"] if ag_f + ag_b else []
        if self.count(REDUCE_SCATTER):
            parts.append(f"{self.count(REDUCE_SCATTER)} RS")
        if self.count(ALL_REDUCE):
            parts.append(f"{self.count(ALL_REDUCE)} AR")
        return " + ".join(parts) or "none"


def step_stats(forward, backward, world_size: int) -> StepStats:
    colls = collectives_of(forward, "forward") + (collectives_of(backward, "backward") if backward is not None else [])
    return StepStats(world_size, tuple(colls), max(live_over_step(forward, backward, gathered_only=True), default=0))


def floor_bytes(param_bytes: int, world_size: int, gathers_per_step: int, reduced_bytes: int | None = None) -> float:
    """Per-rank bytes per step no ZeRO scheme can go below: ``gathers_per_step`` gathers of ``param_bytes`` + 1
    reduce-scatter of ``reduced_bytes`` (default: ``param_bytes``; under mixed precision the two dtypes differ)."""
    reduced = param_bytes if reduced_bytes is None else reduced_bytes
    return (world_size - 1) / world_size * (gathers_per_step * param_bytes + reduced)
