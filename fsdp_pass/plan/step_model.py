"""Predict one step of a candidate plan: its time and its peak memory, from a
:class:`~fsdp_pass.plan.step_summary.StepSummary` and :class:`~fsdp_pass.plan.cost_model.CostInputs`.

``predict(summary, candidate, cost) -> Prediction``. A :class:`Candidate` is what the planner decides: the
units (runs of consecutive pieces), which of them reshard after forward, the prefetch depth (one for all, or
one per unit), offload.

Time: two queues run side by side, the compute queue and the communication queue, each doing its work in
program order (as one CUDA stream each, or gloo's worker), as the scheduled traces issue it:

1. forward, unit by unit: each unit's gather is issued as the schedule issues it (``Schedule``): right after
   the gather ``depth`` places before it arrives (its unit's depth, ``Candidate.depth_of``; at the top for
   the first ones), or, with depth 0, when the unit is about to compute; the leading units that stay
   gathered for the backward all at the top; the unit computes once its gather has arrived;
2. backward, in reverse: the units that resharded are gathered again, the depth counted among these gathers
   (so the first is issued at the top of the backward, whatever the kept units before it); each unit's
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
- gathered units: those kept for the backward (not resharded) since their forward, the unit computing, and
  the gathers issued and not yet used;
- activations: every piece's up to this point of the forward, or not yet passed back in the backward;
- in the backward, the unit's gradients and the flat buffer they are packed into (twice its gradient
  bytes) and the buffers of the two reduce-scatters still in flight, and the gradient of the forward's
  output, which the autograd engine holds through the whole backward.

Not modelled: ``Schedule.max_unused_bytes``, the optimizer step's time, scratch memory inside an op.
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
    depths: tuple[int, ...] = ()  # per unit, its own prefetch depth (empty: every unit ``prefetch``)

    def depth_of(self, unit: int) -> int:
        return self.depths[unit] if self.depths else self.prefetch

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


def _issue_anchors(seq: list[int], candidate: Candidate) -> list[int]:
    """For the gathers ``seq`` (unit indices, in the order a trace uses them): after the wait of which gather
    each is issued, as the schedule does: ``t - depth`` of its unit (-1: at the top of the trace), or ``t`` itself
    for depth 0 (right before its own wait)."""
    return [max(t - candidate.depth_of(u), -1) if candidate.depth_of(u) > 0 else t for t, u in enumerate(seq)]


def _gather_orders(candidate: Candidate, k: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """(forward gathers, their anchors, backward gathers, their anchors). The forward gathers every unit; the
    leading units kept for the backward are all issued at the top (``Schedule.kept_units_first``). The
    backward gathers again the units that resharded, last unit first."""
    forward = list(range(k))
    anchors = _issue_anchors(forward, candidate)
    for t in range(k):
        if candidate.reshard[t]:
            break
        anchors[t] = -1
    backward = [j for j in range(k - 1, -1, -1) if candidate.reshard[j]]
    return forward, anchors, backward, _issue_anchors(backward, candidate)


def _step_seconds(units: list[UnitCost], candidate: Candidate, cost: CostInputs) -> float:
    k, off = len(units), candidate.offload
    forward, f_anchor, backward, b_anchor = _gather_orders(candidate, k)
    comm = 0.0  # when the communication queue is free
    compute = 0.0  # when the compute queue is free

    def gather(u: UnitCost, issued: float) -> float:
        nonlocal comm
        comm = max(comm, issued) + _host_copy_s(u.shard, cost, off) + u.gather_s
        return comm

    def issue_due(seq, anchors, arrived, at: int, now: float) -> None:
        for t in range(len(seq)):
            if anchors[t] == at and t != at and t not in arrived:
                arrived[t] = gather(units[seq[t]], now)

    # forward: arrived[t] is when gather t is done
    arrived: dict[int, float] = {}
    issue_due(forward, f_anchor, arrived, -1, 0.0)
    for t, i in enumerate(forward):
        if t not in arrived:  # depth 0: issued when it is needed
            arrived[t] = gather(units[i], compute)
        start = max(compute, arrived[t])
        issue_due(forward, f_anchor, arrived, t, start)
        compute = start + units[i].forward_s
    # backward, last unit first; the units that resharded are gathered again
    position = {j: t for t, j in enumerate(backward)}
    back: dict[int, float] = {}
    issue_due(backward, b_anchor, back, -1, compute)
    reduced: list[float] = []
    for j in range(k - 1, -1, -1):
        start = compute
        if j in position:
            t = position[j]
            if t not in back:
                back[t] = gather(units[j], compute)
            start = max(compute, back[t])
            issue_due(backward, b_anchor, back, t, start)
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


def _issued_unused(seq: list[int], anchors: list[int], units: list[UnitCost]) -> list[int]:
    """Bytes of the gathers issued and not yet waited for once gather ``w`` has been waited: entry ``w + 1``
    (entry 0: before any wait). Gather ``t`` counts from its issue (after wait ``anchors[t]``) to wait ``t - 1``."""
    diff = [0] * (len(seq) + 2)
    for t, a in enumerate(anchors):
        if a != t:
            diff[a + 1] += units[seq[t]].gathered
            diff[t + 1] -= units[seq[t]].gathered
    out, running = [], 0
    for d in diff[:-1]:
        running += d
        out.append(running)
    return out


def peak_of(
    units: list[UnitCost], candidate: Candidate, names: list[str], persistent: int, output_grad: int = 0
) -> tuple[int, str]:
    k = len(units)
    forward, f_anchor, backward, b_anchor = _gather_orders(candidate, k)
    f_unused, b_unused = _issued_unused(forward, f_anchor, units), _issued_unused(backward, b_anchor, units)
    best, where = persistent, "between steps"
    acts = 0
    kept = 0  # gathered units before this one that stay gathered for the backward
    for i in range(k):
        acts += units[i].activations
        live = persistent + kept + units[i].gathered + f_unused[i + 1] + acts
        if live > best:
            best, where = live, f"forward of {names[i]}"
        if not candidate.reshard[i]:
            kept += units[i].gathered
    latest_wait = -1  # the backward gathers waited for so far
    for j in range(k - 1, -1, -1):
        if not candidate.reshard[j]:
            kept -= units[j].gathered
        else:
            latest_wait += 1
        ahead = b_unused[latest_wait + 1]
        in_flight = sum(u.grads for u in units[j + 1 : j + 1 + REDUCE_SCATTERS_IN_FLIGHT])
        live = persistent + kept + units[j].gathered + ahead + acts + 2 * units[j].grads + in_flight
        live += output_grad
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
    peak, where = peak_of(units, candidate, names, persistent, summary.output_bytes)
    return Prediction(
        _step_seconds(units, candidate, cost), sum(3 * u.forward_s for u in units), peak, where, persistent
    )
