"""Predict one step of a candidate plan: its time and its peak memory, from a
:class:`~fsdp_pass.plan.step_summary.StepSummary` and :class:`~fsdp_pass.plan.cost_model.CostInputs`.

``predict(summary, candidate, cost) -> Prediction``. A :class:`Candidate` is what the planner decides: the
units (runs of consecutive pieces), which of them reshard after forward, the prefetch depth, offload.

Time: two queues run side by side, the compute queue and the communication queue, each doing its work in
program order (as one CUDA stream each, or gloo's worker), as the scheduled traces issue it:

1. forward, unit by unit: unit ``i + prefetch`` is gathered as soon as unit ``i``'s gather arrives (with
   prefetch 0, when unit ``i`` is about to compute); the unit computes once its gather has arrived;
2. backward, in reverse: the units that resharded are gathered again, prefetched the same way; each unit's
   gradients are reduce-scattered when its backward ends (twice the forward's FLOPs), after the wait for the
   reduce-scatter two units back (two in flight, the default schedule);
3. with offload, each gather is preceded by the copy of its shards to the device, and each reduce-scatter
   followed by the copy of its gradient shard back, on the communication queue.

A gather or reduce-scatter costs the link's ``alpha + sent / beta``; compute costs FLOPs / the device rate.
The step ends when both queues are done; what is not compute is *exposed* communication. Where the two
queues share the same cores (``CostInputs.overlap`` below 1: gloo's threads and the compute on one CPU), the
communication that ran beside compute slows it by the share it does not hide.

Memory, per rank, at the start of each unit's forward and backward:

- between steps: the shards, their gradient shards and the optimizer states (none of it with offload);
- gathered units: those kept for the backward (not resharded) since their forward, and the window being
  computed plus the prefetched ones;
- activations: every piece's up to this point of the forward, or not yet passed back in the backward;
- in the backward, the unit's gradients and the flat buffer they are packed into (twice its gradient
  bytes) and the buffers of the two reduce-scatters still in flight.

Not modelled: the order ZeRO-2 units are gathered in (all at the top of the forward by default: the same peak,
at the end of the forward), the optimizer step's time, scratch memory inside an op.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_pass.op_names import ALL_GATHER, REDUCE_SCATTER
from fsdp_pass.plan.cost_model import CostInputs
from fsdp_pass.plan.step_summary import StepSummary

REDUCE_SCATTERS_IN_FLIGHT = 2  # the default Schedule's bound


@dataclass(frozen=True)
class Candidate:
    starts: tuple[int, ...]  # the index of each unit's first piece; the first is 0
    reshard: tuple[bool, ...]  # per unit: gathered again in the backward (ZeRO-3) or kept (ZeRO-2)
    prefetch: int = 1
    offload: bool = False

    def spans(self, n_pieces: int) -> list[range]:
        ends = (*self.starts[1:], n_pieces)
        return [range(a, b) for a, b in zip(self.starts, ends)]


@dataclass(frozen=True)
class UnitCost:
    gathered: int
    grads: int
    shard: int
    activations: int
    forward_s: float
    gather_s: float
    reduce_s: float


@dataclass(frozen=True)
class Prediction:
    step_s: float
    compute_s: float
    peak_bytes: int
    peak_at: str  # where the peak is: "forward of <unit>" / "backward of <unit>"
    persistent_bytes: int  # the part of the peak that lives between steps

    @property
    def exposed_s(self) -> float:
        return max(self.step_s - self.compute_s, 0.0)


def unit_costs(summary: StepSummary, candidate: Candidate, cost: CostInputs) -> list[UnitCost]:
    out = []
    for span in candidate.spans(len(summary.pieces)):
        ps = [summary.pieces[i] for i in span]
        gathered, grads = sum(p.gathered_bytes for p in ps), sum(p.grad_bytes for p in ps)
        out.append(
            UnitCost(
                gathered,
                grads,
                sum(p.shard_bytes for p in ps),
                sum(p.activation_bytes for p in ps),
                cost.compute_seconds(sum(p.flops for p in ps)),
                cost.link.seconds(gathered, summary.ranks, ALL_GATHER),
                cost.link.seconds(grads, summary.ranks, REDUCE_SCATTER),
            )
        )
    return out


def _host_copy_s(nbytes: int, cost: CostInputs, offload: bool) -> float:
    if not offload:
        return 0.0
    return nbytes / cost.host_bytes_per_s if cost.host_bytes_per_s else 0.0


def _step_seconds(units: list[UnitCost], candidate: Candidate, cost: CostInputs) -> float:
    d, k, off = candidate.prefetch, len(units), candidate.offload
    comm = 0.0  # when the communication queue is free
    compute = 0.0  # when the compute queue is free

    def gather(u: UnitCost, issued: float) -> float:
        nonlocal comm
        comm = max(comm, issued) + _host_copy_s(u.shard, cost, off) + u.gather_s
        return comm

    # forward: arrived[i] is when unit i's gather is done
    arrived: dict[int, float] = {}
    for i in range(min(d, k)):
        arrived[i] = gather(units[i], 0.0)
    for i in range(k):
        if i not in arrived:
            arrived[i] = gather(units[i], compute)  # prefetch 0: issued when it is needed
        start = max(compute, arrived[i])
        if i + d < k and d > 0 and i + d not in arrived:
            arrived[i + d] = gather(units[i + d], start)
        compute = start + units[i].forward_s
    # backward, last unit first; the units that resharded are gathered again
    order = list(range(k - 1, -1, -1))  # order[pos] is the unit the backward does pos-th
    back_arrived: dict[int, float] = {}
    for j in order[:d]:
        if candidate.reshard[j]:
            back_arrived[j] = gather(units[j], compute)
    reduced: list[float] = []
    for pos, j in enumerate(order):
        if candidate.reshard[j] and j not in back_arrived:
            back_arrived[j] = gather(units[j], compute)
        start = max(compute, back_arrived.get(j, 0.0))
        if d > 0 and pos + d < k and candidate.reshard[order[pos + d]]:
            back_arrived[order[pos + d]] = gather(units[order[pos + d]], start)
        compute = start + 2 * units[j].forward_s
        if len(reduced) >= REDUCE_SCATTERS_IN_FLIGHT:  # wait for the one issued two units back
            compute = max(compute, reduced[-REDUCE_SCATTERS_IN_FLIGHT])
        comm = max(comm, compute) + units[j].reduce_s + _host_copy_s(units[j].shard, cost, off)
        reduced.append(comm)
    both_done = max(compute, comm)
    communication = sum(u.gather_s * (2 if r else 1) + u.reduce_s for u, r in zip(units, candidate.reshard))
    communication += sum(2 * _host_copy_s(u.shard, cost, off) for u in units)
    beside_compute = max(communication - (both_done - sum(3 * u.forward_s for u in units)), 0.0)
    return both_done + (1 - cost.overlap) * beside_compute


def peak_of(units: list[UnitCost], candidate: Candidate, names: list[str], persistent: int) -> tuple[int, str]:
    d, k = candidate.prefetch, len(units)
    best, where = persistent, "between steps"
    acts = 0
    kept = 0  # gathered units before this one that stay gathered for the backward
    for i in range(k):
        acts += units[i].activations
        window = sum(u.gathered for u in units[i : i + d + 1])
        live = persistent + kept + window + acts
        if live > best:
            best, where = live, f"forward of {names[i]}"
        if not candidate.reshard[i]:
            kept += units[i].gathered
    for j in range(k - 1, -1, -1):
        if not candidate.reshard[j]:
            kept -= units[j].gathered
        ahead = [units[n].gathered for n in range(j - 1, max(j - 1 - d, -1), -1) if candidate.reshard[n]]
        in_flight = sum(u.grads for u in units[j + 1 : j + 1 + REDUCE_SCATTERS_IN_FLIGHT])
        live = persistent + kept + units[j].gathered + sum(ahead) + acts + 2 * units[j].grads + in_flight
        if live > best:
            best, where = live, f"backward of {names[j]}"
        acts -= units[j].activations
    return best, where


def persistent_bytes(summary: StepSummary, offload: bool) -> int:
    """What lives on the device between steps: shards, gradient shards, optimizer states (none offloaded)."""
    return 0 if offload else summary.shard_bytes * (2 + summary.optimizer_states)


def predict(summary: StepSummary, candidate: Candidate, cost: CostInputs, names: list[str] | None = None) -> Prediction:
    units = unit_costs(summary, candidate, cost)
    names = names or [summary.pieces[s.start].name for s in candidate.spans(len(summary.pieces))]
    persistent = persistent_bytes(summary, candidate.offload)
    peak, where = peak_of(units, candidate, names, persistent)
    return Prediction(
        _step_seconds(units, candidate, cost), sum(3 * u.forward_s for u in units), peak, where, persistent
    )
