"""Predict one step of a candidate plan: its time and its peak memory, from a
:class:`~fsdp_pass.cost.step_summary.StepSummary` and :class:`~fsdp_pass.cost.cost_model.CostInputs`.

``predict(summary, candidate, cost) -> Prediction``. A :class:`Candidate` is what the planner decides: the
units (runs of consecutive pieces), which of them reshard after forward, the prefetch depth (one for all, or
one per unit), offload. Each unit's own bytes and seconds are :mod:`~fsdp_pass.cost.candidate_costs`'s
(:func:`unit_costs`, with :class:`Candidate`, :func:`kept_and_recompute` and the constants named below); this
module runs them through the step's two queues and its memory.

Time: two queues run side by side, the compute queue and the communication queue, each doing its work in
program order (as one CUDA stream each, or gloo's worker), as the scheduled traces issue it:

1. forward, unit by unit: each unit's gather is issued as the schedule issues it (``Schedule``): right after
   the gather ``depth`` places before it arrives (its unit's depth, ``Candidate.depth_of``; at the top for
   the first ones), or, with depth 0, when the unit is about to compute; the leading units that stay
   gathered for the backward all at the top; the unit computes once its gather has arrived;
2. backward, in reverse: the units that resharded are gathered again where their backward reads their parameters
   (``Piece.backward_reads_params``: an embedding's does not), the depth counted among these gathers
   (so the first is issued at the top of the backward, whatever the kept units before it); each unit's
   gradients are reduce-scattered when its backward ends (twice the forward's FLOPs), after the wait for the
   reduce-scatter two units back (two in flight, the default schedule);
3. with offload, each gather is preceded by the copy of its shards to the device, and each reduce-scatter
   followed by the copy of its gradient shard back, on the communication queue.

A gather or reduce-scatter costs the link's ``alpha + sent / beta`` (an 8-bit gather sends its codes and scales,
``UnitCost.codes``); under HSDP each reduce-scatter is followed,
on the same queue, by the all-reduce of the reduced shard across the replicas (``CostInputs.across_replicas``:
``alpha + 2(R-1)/R * shard / beta``). A unit's compute costs
(``CostInputs.compute_seconds``) its matmul FLOPs / the matmul rate, plus the bytes its elementwise ops move / the
memory rate, plus each op's host time: the functional trace's ops times :data:`EXECUTED_OPS_PER_TRACE_OP` (what
the torch executor runs per traced op), summed with the device time on a CPU, the longer of the two where the
host runs ahead (CUDA). The backward computes twice the forward in every term. Each collective adds
:data:`OPS_PER_COLLECTIVE` ops on the compute queue (pack, collective, wait, unpack) and the copies of its packing
and unpacking. The optimizer steps after the backward (``CostInputs.optimizer_seconds``: per parameter tensor,
per byte of this rank's shards, AdamW's scaled to the summary's optimizer, :mod:`~fsdp_pass.plan.optimizers`;
offloaded, it steps on the host, priced the same). A checkpointed unit's backward
first recomputes what it did not keep (:func:`kept_and_recompute`: its whole forward, or for the selective level
all but its matmuls and attentions). The step ends when both queues and the optimizer are done; what is neither compute nor the optimizer is *exposed* communication. Where
the two queues share the same cores (``CostInputs.overlap`` below 1: gloo's threads and the compute on one CPU),
the communication that ran beside compute slows it by the share it does not hide.

Memory, per rank, at each unit's unpack, at the end of its forward and at both ends of its backward:

- between steps: the shards and the optimizer states (neither with offload);
- gradient shards: each unit's from its reduce-scatter in the backward until the optimizer has stepped (torch's
  ``zero_grad()`` frees them; none on the device with offload), so all of them at the optimizer's step;
- gathered units: those kept for the backward (not resharded) since their forward, where their backward reads
  their parameters (``UnitCost.reads_params``: an embedding's reads its indices only, so the forward saves none of
  its gathered parameters and frees them after their last read, kept or resharded), the unit computing, and
  the gathers issued and not yet used (none over a group of one rank, where the schedule packs each gather's buffer
  right before its use: it moves nothing); a unit of several parameters twice at its unpack, which copies them out
  of the gathered buffer, freed once the unpack has run (the next gather, issued after this one's wait, not yet).
  Held bytes are the parameters in the compute dtype; an 8-bit gather's (``UnitCost.codes``) holds its gathered
  buffer of codes and scales, what it sends, from its issue until its dequantize, and at the dequantize both that
  buffer and the dequantized parameters (the ops' float32 scratch chunks are left out);
- activations: every piece's up to this point of the forward, or not yet freed in the backward: a kept result is
  freed by the backward of the first op that keeps it, so the results a later piece keeps (a block's output, the
  next norm's input), and those that ops after a piece's last parameter read keep (the residual sum, the next
  norm's reduction: their backward runs before the unit is gathered again), are freed in that later unit's backward
  (``UnitCost.freed_later``); a checkpointed unit's: what it keeps, at the start of its backward what it recomputes;
- before the backward, where the caller computes the loss on the outputs (``StepSummary.loss_bytes``, a
  cross-entropy's log-probabilities and their gradient): those, the outputs' gradients, the kept units and every
  activation, no backward gather issued yet (the loss runs before the backward trace);
- where the forward computes the loss itself (the ops after its last parameter read, ``UnitCost.tail_working``):
  its backward first, on the same bytes, with the gradient one of its ops receives and the one it makes (each as
  large as the loss's largest result) in place of the caller's loss, and no backward gather issued yet (the schedule
  issues the first right before the first op that computes with gathered parameters); what the loss kept (its
  log-probabilities, the logits a mean of squares reads again: the last unit's activations) is freed there, before
  the last unit's own backward, which frees the rest of them;
- in the backward, the buffers of the two reduce-scatters still in flight (none over a group of one rank, where a
  reduce-scatter returns its input, the gradient shard counted above), the gathers issued and not yet used,
  and the larger of the unit's two ends: its start (its gathered parameters, its activations, the gradient it
  receives: for the last unit the gradients of the forward's outputs, which the backward receives and frees once
  its ops have read them (the memory report's rule 5: torch's autograd engine keeps no reference), for another the
  largest of its results the later units read (``UnitCost.received``, unfused lists), live while its last piece's
  first op reads it, and its working set: the gradient an op makes, :data:`WORKING_RESULTS` times its largest
  forward result (each op's backward frees the saved activations it read as it makes the next gradients), or an
  attention's score gradients, under fusion :data:`FUSED_WORKING_RESULTS`; checkpointed, what it
  recomputed) and its end (its gradients in the gathered dtype and the flat buffer they are packed into in the
  reduce dtype, the gradient it hands on to the unit before it, its parameters and activations freed: the ops that
  make the gradients read them for the last time).

Not modelled: ``Schedule.max_unused_bytes``, scratch memory inside an op, fusion (a fused region is one op with
less memory traffic: the inputs' op and byte terms are then upper bounds), the forward's temporaries (a loss the
forward computes holds its logits and two more results as large at its last ops: on the CPU the same bytes as its
backward's point, which the model counts).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_pass.cost.candidate_costs import Candidate, UnitCost, unit_costs
from fsdp_pass.cost.cost_model import CostInputs
from fsdp_pass.cost.step_summary import StepSummary
from fsdp_pass.text import human_bytes

REDUCE_SCATTERS_IN_FLIGHT = 2  # the default Schedule's bound


@dataclass(frozen=True)
class Prediction:
    step_s: float
    compute_s: float
    peak_bytes: int
    peak_at: str  # where the peak is: "forward of <unit>" / "backward of <unit>"
    persistent_bytes: int  # the part of the peak that lives between steps
    optimizer_s: float = 0.0

    @property
    def exposed_s(self) -> float:
        return max(self.step_s - self.compute_s - self.optimizer_s, 0.0)

    def lines(self, budget: int | None = None) -> list[str]:
        """The step split into its parts, and the peak (against ``budget`` when given)."""
        return [
            f"predicted step {ms(self.step_s)} = compute {ms(self.compute_s)}"
            + (f" + optimizer {ms(self.optimizer_s)}" if self.optimizer_s else "")
            + f" + exposed communication {ms(self.exposed_s)}",
            f"predicted peak {human_bytes(self.peak_bytes)} ({self.peak_at}; {human_bytes(self.persistent_bytes)} of "
            "it between steps)" + ("" if budget is None else f" of the {human_bytes(budget)} budget"),
        ]

    def __str__(self) -> str:
        return "\n".join(self.lines())


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _host_copy_s(nbytes: int, cost: CostInputs, offload: bool) -> float:
    if not offload:
        return 0.0
    return nbytes / cost.host_bytes_per_s if cost.host_bytes_per_s else 0.0


def _issue_anchors(seq: list[int], candidate: Candidate, one_rank: bool = False) -> list[int]:
    """For the gathers ``seq`` (unit indices, in the order a trace uses them): after the wait of which gather
    each is issued, as the schedule does: ``t - depth`` of its unit (-1: at the top of the trace), or ``t`` itself
    for depth 0 (right before its own wait), as every gather over a group of one rank (``one_rank``: it moves
    nothing, and the schedule packs its buffer right before its use)."""
    depth = (lambda u: 0) if one_rank else candidate.depth_of
    return [max(t - depth(u), -1) if depth(u) > 0 else t for t, u in enumerate(seq)]


def _gather_orders(candidate: Candidate, units: list[UnitCost]) -> tuple[list[int], list[int], list[int], list[int]]:
    """(forward gathers, their anchors, backward gathers, their anchors). The forward gathers every unit; the
    leading units kept for the backward are all issued at the top (``Schedule.kept_units_first``). The
    backward gathers again the units that resharded and whose backward reads their parameters, last unit first."""
    k = len(units)
    one_rank = bool(units) and units[0].reduced_in_place  # a group of one rank
    forward = list(range(k))
    anchors = _issue_anchors(forward, candidate, one_rank)
    for t in range(k):
        if candidate.reshard[t]:
            break
        anchors[t] = -1
    backward = [j for j in range(k - 1, -1, -1) if units[j].gathered_again(candidate.reshard[j])]
    return forward, anchors, backward, _issue_anchors(backward, candidate, one_rank)


def _step_seconds(units: list[UnitCost], candidate: Candidate, cost: CostInputs) -> float:
    k, off = len(units), candidate.offload
    forward, f_anchor, backward, b_anchor = _gather_orders(candidate, units)
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
        compute = start + units[i].forward_total_s()
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
        compute = start + units[j].backward_total_s(candidate.reshard[j])
        if len(reduced) >= REDUCE_SCATTERS_IN_FLIGHT:  # wait for the one issued two units back
            compute = max(compute, reduced[-REDUCE_SCATTERS_IN_FLIGHT])
        comm = max(comm, compute) + units[j].reduce_s + _host_copy_s(units[j].shard, cost, off)
        reduced.append(comm)
    both_done = max(compute, comm)
    communication = sum(u.gather_s * (2 if u.gathered_again(r) else 1) + u.reduce_s
                        for u, r in zip(units, candidate.reshard))
    communication += sum(2 * _host_copy_s(u.shard, cost, off) for u in units)
    beside_compute = max(communication - (both_done - compute_seconds(units, candidate)), 0.0)
    return both_done + (1 - cost.overlap) * beside_compute


def compute_seconds(units: list[UnitCost], candidate: Candidate) -> float:
    """The compute queue's own work: every unit's forward and backward, with FSDP's ops around its collectives."""
    return sum(u.forward_total_s() + u.backward_total_s(r) for u, r in zip(units, candidate.reshard))


def optimizer_seconds(summary: StepSummary, cost: CostInputs) -> float:
    """The optimizer step over this rank's shards (offloaded, it runs on the host: at the same rates here): the
    probed AdamW's per tensor and per byte, scaled to the summary's optimizer (plan.optimizers)."""
    o = summary.optimizer
    return (o.tensor_scale * cost.optimizer_seconds(summary.tensors, 0)
            + o.byte_scale * cost.optimizer_seconds(0, summary.shard_bytes))


def _issued_unused(seq: list[int], anchors: list[int], units: list[UnitCost]) -> list[int]:
    """Bytes of the gathers issued and not yet waited for once gather ``w`` has been waited: entry ``w + 1``
    (entry 0: before any wait). Gather ``t`` counts from its issue (after wait ``anchors[t]``) to wait ``t - 1``."""
    diff = [0] * (len(seq) + 2)
    for t, a in enumerate(anchors):
        if a != t:
            diff[a + 1] += units[seq[t]].in_flight
            diff[t + 1] -= units[seq[t]].in_flight
    out, running = [], 0
    for d in diff[:-1]:
        running += d
        out.append(running)
    return out


def _issued_before(seq: list[int], anchors: list[int], units: list[UnitCost]) -> list[int]:
    """Bytes of the other gathers issued and not yet waited for when gather ``t`` is waited and unpacked: entry
    ``t`` (those issued after an earlier wait, or at the top, and used after it)."""
    return [sum(units[seq[s]].in_flight for s in range(t + 1, len(seq)) if anchors[s] < t) for t in range(len(seq))]


class _Peak:
    """The highest live bytes seen so far, and where."""

    def __init__(self, live: int, at: str):
        self.bytes, self.where = live, at

    def point(self, live: int, at: str) -> None:
        if live > self.bytes:
            self.bytes, self.where = live, at


def peak_of(
    units: list[UnitCost], candidate: Candidate, names: list[str], persistent: int, output_grad: int = 0,
    loss: int = 0,
) -> tuple[int, str]:
    forward, f_anchor, backward, b_anchor = _gather_orders(candidate, units)
    peak = _Peak(persistent, "between steps")
    acts, kept = _forward_peaks(peak, units, candidate, names, persistent, _issued_unused(forward, f_anchor, units),
                                _issued_before(forward, f_anchor, units))
    # the caller's loss, before the backward trace: its bytes beside the outputs' gradients, the kept units (the last
    # one too where kept) and every activation, no backward gather issued yet
    if loss:
        peak.point(persistent + kept + acts + output_grad + loss, "the caller's loss, before the backward")
    # a loss the forward computed: its backward comes first, on the same bytes, with its own working set in place of
    # the caller's; the schedule issues no backward gather above it (schedule_collectives, step 3)
    last = units[-1] if units else None
    if last is not None and last.tail_working:
        peak.point(persistent + kept + acts + output_grad + last.tail_working,
                   f"the loss's backward, before {names[-1]}'s")
        acts -= last.tail_activations
    reduced = _backward_peaks(peak, units, candidate, names, persistent, output_grad, acts, kept,
                              _issued_unused(backward, b_anchor, units), _issued_before(backward, b_anchor, units))
    peak.point(persistent + reduced, "optimizer step")
    return peak.bytes, peak.where


def _forward_peaks(peak: _Peak, units, candidate, names, persistent: int, f_unused, f_before) -> tuple[int, int]:
    """Records each unit's forward points in ``peak``; returns the activations kept and the bytes of the units that
    stay gathered for the backward, at the forward's end."""
    acts = 0
    kept = 0  # gathered units before this one that stay gathered for the backward
    for i in range(len(units)):
        # an 8-bit gather's dequantize: the received codes and the dequantized buffer
        if units[i].codes:
            peak.point(persistent + kept + units[i].codes + units[i].gathered + f_before[i] + acts,
                       f"forward of {names[i]}")
        # its unpack: the gathered buffer and the parameters copied out of it, before its ops run
        if units[i].copies_out:
            peak.point(persistent + kept + 2 * units[i].gathered + f_before[i] + acts, f"forward of {names[i]}")
        acts += units[i].activations
        peak.point(persistent + kept + units[i].gathered + f_unused[i + 1] + acts, f"forward of {names[i]}")
        if not candidate.reshard[i] and units[i].reads_params:  # else freed after its forward's last read
            kept += units[i].gathered
    return acts, kept


def _freed_at(units) -> dict[int, int]:
    """A unit -> the earlier units' activations its backward frees."""
    freed_at: dict[int, int] = {}
    for u in units:
        for v, b in u.freed_later:
            freed_at[v] = freed_at.get(v, 0) + b
    return freed_at


def _backward_peaks(peak: _Peak, units, candidate, names, persistent: int, output_grad: int, acts: int, kept: int,
                    b_unused, b_before) -> int:
    """Records each unit's backward points in ``peak``, last unit first; returns the gradient shards kept on the
    device at the backward's end."""
    k = len(units)
    latest_wait = -1  # the backward gathers waited for so far
    reduced = 0  # the gradient shards the backward has made so far
    freed_at = _freed_at(units)
    for j in range(k - 1, -1, -1):
        gathered = units[j].gathered  # kept since its forward, or gathered again
        again = False
        if not units[j].reads_params:  # kept or resharded, freed after its forward's last read
            gathered = 0
        elif not candidate.reshard[j]:
            kept -= units[j].gathered
        else:
            latest_wait += 1
            again = True
        ahead = b_unused[latest_wait + 1]
        in_flight = sum(u.grads for u in units[j + 1 : j + 1 + REDUCE_SCATTERS_IN_FLIGHT] if not u.reduced_in_place)
        common = persistent + reduced + kept + in_flight
        received = output_grad if j == k - 1 else units[j].received  # the gradient its backward starts from
        if again and units[j].codes:  # its dequantize: the received codes and the dequantized buffer
            codes = units[j].codes
            peak.point(common + b_before[latest_wait] + codes + gathered + acts + received, f"backward of {names[j]}")
        if again and units[j].copies_out:  # its unpack, before its ops: the gathered buffer and the copies out of it
            peak.point(common + b_before[latest_wait] + 2 * gathered + acts + received, f"backward of {names[j]}")
        # its backward starts with its parameters gathered, its activations kept (less those a later unit's backward
        # read last and freed), its working set: the gradient it receives and the one an op makes (the last unit's:
        # the forward's outputs' gradients, which its ops read and free, beside it), and ends with its gradients
        # packed for the reduce-scatter, its activations freed (the ops that make the gradients read them for the last
        # time) and the gradient it hands on to the unit before it
        start = gathered + acts + units[j].recomputed + units[j].working + (output_grad if j == k - 1 else 0)
        # (less what the loss's backward freed before it: the last unit's results the loss kept, its logits)
        acts -= (units[j].activations - units[j].tail_activations - sum(b for _, b in units[j].freed_later)
                 + freed_at.get(j, 0))
        made = units[j].compute_grads or units[j].grads  # its gradients, then their copy packed for the reduce
        handed_on = units[j - 1].received if j else 0
        peak.point(common + ahead + max(start, acts + made + units[j].grads + handed_on), f"backward of {names[j]}")
        reduced += 0 if candidate.offload else units[j].shard
    return reduced


def persistent_bytes(summary: StepSummary, offload: bool) -> int:
    """What lives on the device between steps: the shards and their optimizer states (none offloaded)."""
    return 0 if offload else summary.state_bytes


def predict(summary: StepSummary, candidate: Candidate, cost: CostInputs, names: list[str] | None = None) -> Prediction:
    units = unit_costs(summary, candidate, cost)
    names = names or [summary.pieces[s.start].name for s in candidate.spans(len(summary.pieces))]
    persistent = persistent_bytes(summary, candidate.offload)
    peak, where = peak_of(units, candidate, names, persistent, summary.output_bytes, summary.loss_bytes)
    optimizer = optimizer_seconds(summary, cost)
    return Prediction(
        _step_seconds(units, candidate, cost) + optimizer, compute_seconds(units, candidate), peak, where,
        persistent, optimizer,
    )
