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
2. backward, in reverse: the units that resharded are gathered again where their backward reads their parameters
   (``Piece.backward_reads_params``: an embedding's does not), the depth counted among these gathers
   (so the first is issued at the top of the backward, whatever the kept units before it); each unit's
   gradients are reduce-scattered when its backward ends (twice the forward's FLOPs), after the wait for the
   reduce-scatter two units back (two in flight, the default schedule);
3. with offload, each gather is preceded by the copy of its shards to the device, and each reduce-scatter
   followed by the copy of its gradient shard back, on the communication queue.

A gather or reduce-scatter costs the link's ``alpha + sent / beta``; under HSDP each reduce-scatter is followed,
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

Memory, per rank, at the end of each unit's forward and at both ends of its backward:

- between steps: the shards and the optimizer states (neither with offload);
- gradient shards: each unit's from its reduce-scatter in the backward until the optimizer has stepped (torch's
  ``zero_grad()`` frees them; none on the device with offload), so all of them at the optimizer's step;
- gathered units: those kept for the backward (not resharded) since their forward, the unit computing, and
  the gathers issued and not yet used;
- activations: every piece's up to this point of the forward, or not yet passed back in the backward (a
  checkpointed unit's: what it keeps; at the start of its backward what it recomputes too);
- in the backward, the buffers of the two reduce-scatters still in flight, the gathers issued and not yet used,
  the gradient of the forward's output, which the autograd engine holds through the whole backward, and the
  larger of the unit's two ends: its start (its gathered parameters, its activations, and its working set:
  :data:`WORKING_RESULTS` times its largest forward result, the gradient an op receives, the one it makes, a
  temporary, one of them under fusion, :data:`FUSED_WORKING_RESULTS`; checkpointed, what it recomputed) and its end
  (its gradients in the gathered dtype and the flat buffer they are packed into in the reduce dtype,
  its parameters and activations freed: the ops that make the gradients read them for the last time).

Not modelled: ``Schedule.max_unused_bytes``, scratch memory inside an op, fusion (a fused region is one op with
less memory traffic: the inputs' op and byte terms are then upper bounds).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_pass.op_names import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from fsdp_pass.plan.checkpointing import FULL, NONE
from fsdp_pass.plan.cost_model import CostInputs
from fsdp_pass.plan.step_summary import StepSummary
from fsdp_pass.report.text import human_bytes

REDUCE_SCATTERS_IN_FLIGHT = 2  # the default Schedule's bound
# ops the torch executor runs per op of the functional trace (views, re-layouts and decompositions added): the
# benchmark model's forward, 136 traced ops run as 259 (backward 544, about twice), `scratch` count of
# thunder.last_traces, 2026-11-25
EXECUTED_OPS_PER_TRACE_OP = 1.9
# FSDP's own ops per collective on the compute queue: pack, the collective, its wait, unpack (the final traces)
OPS_PER_COLLECTIVE = 4
# the backward's working set, in a unit's largest forward result: the gradient an op receives, the one it makes and
# a temporary as large (the bench model's loss: the logits' gradient, log-softmax's and nll's; the traces, 2026-11-25)
WORKING_RESULTS = 3
# the same where a fusion executor runs the elementwise ops (the CUDA lowering): the gradient of the largest result,
# which a fused kernel writes for the matmul after it, the temporaries staying inside the kernel; beside it the
# parameter gradients the unit's backward has made so far (``_working``). Llama-3-8B's shape, 4 layers, 2 x 8192
# tokens, bf16, selective: the head's backward is one fused region reading the 4 GiB saved logits and writing the
# head's weight gradient; with 3 x 4 GiB counted the model was 10.6 GiB over the traced peak, now 3.8 GiB over, the
# logits' gradient, which the region holds for its matmuls and the traces cannot see inside it. Llama-2-7B's shape,
# 4 layers, 2 x 4096 tokens, none: 6.56 GiB against a traced 6.57 (before: 6.98)
FUSED_WORKING_RESULTS = 1
# an attention computed op by op: its backward makes the gradients of its probabilities and of its scores, each as
# large as the scores (the tiny Llama's CPU lowering at 1024 tokens: two b*h*s*s buffers live at its backward's peak)
SCORE_GRADIENTS = 2


@dataclass(frozen=True)
class Candidate:
    starts: tuple[int, ...]  # the index of each unit's first piece; the first is 0
    reshard: tuple[bool, ...]  # per unit: gathered again in the backward (ZeRO-3) or kept (ZeRO-2)
    prefetch: int = 1
    offload: bool = False
    depths: tuple[int, ...] = ()  # per unit, its own prefetch depth (empty: every unit ``prefetch``)
    checkpoint: tuple[str, ...] = ()  # per unit, its activation checkpointing level (empty: none anywhere)

    def depth_of(self, unit: int) -> int:
        return self.depths[unit] if self.depths else self.prefetch

    def level_of(self, unit: int) -> str:
        return self.checkpoint[unit] if self.checkpoint else NONE

    def spans(self, n_pieces: int) -> list[range]:
        ends = (*self.starts[1:], n_pieces)
        return [range(a, b) for a, b in zip(self.starts, ends)]


@dataclass(frozen=True)
class UnitCost:
    gathered: int
    grads: int
    shard: int
    activations: int
    forward_s: float  # the unit's own forward compute (its backward: twice)
    gather_s: float  # on the link
    reduce_s: float
    gather_ops_s: float = 0.0  # on the compute queue: packing, issuing, waiting for, unpacking one gather
    reduce_ops_s: float = 0.0  # the same for its reduce-scatter
    working: int = 0  # its backward's gradients of activations and temporaries
    recomputed: int = 0  # checkpointed: what its backward recomputes before it starts (``activations``: what it keeps)
    recompute_s: float = 0.0  # the time that takes
    # its backward reads its parameters: resharded, it is gathered again (an embedding's is not: its gradient reads
    # the indices only, and Thunder's autodiff gathers a unit again only where the backward reads it)
    reads_params: bool = True
    compute_grads: int = 0  # its gradients as the backward makes them, in the gathered dtype (0: ``grads``)

    def forward_total_s(self) -> float:
        return self.forward_s + self.gather_ops_s

    def gathered_again(self, reshards: bool) -> bool:
        return reshards and self.reads_params

    def backward_total_s(self, reshards: bool) -> float:
        again = self.gathered_again(reshards)
        return 2 * self.forward_s + self.recompute_s + self.reduce_ops_s + (self.gather_ops_s if again else 0.0)


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


def kept_and_recompute(summary: StepSummary, span: range, level: str, cost: CostInputs) -> tuple[int, float]:
    """(bytes the unit of ``span``'s pieces keeps for its backward, seconds its backward recomputes) at checkpointing
    ``level``: none keeps every piece's activations; full keeps what pieces after the unit read of it and
    recomputes its whole forward; selective keeps that and its matmuls' and attentions' results, and recomputes
    the rest (their elementwise bytes, their ops on the host)."""
    ps = [summary.pieces[i] for i in span]
    every = sum(p.activation_bytes for p in ps)
    if level == NONE:
        return every, 0.0
    read_later = sum(b for p in ps for reader, b in p.read_later if reader >= span.stop)
    flops, ops, moved = sum(p.flops for p in ps), sum(p.ops for p in ps), sum(p.moved_bytes for p in ps)
    if level == FULL:
        return min(every, read_later), cost.compute_seconds(flops, EXECUTED_OPS_PER_TRACE_OP * ops, moved)
    both = sum(b for p in ps for reader, b in p.matmul_read_later if reader >= span.stop)  # counted once
    kept = min(every, read_later + sum(p.matmul_activation_bytes for p in ps) - both)
    rest_ops = EXECUTED_OPS_PER_TRACE_OP * (ops - sum(p.matmul_ops for p in ps))
    return kept, cost.compute_seconds(flops - sum(p.matmul_flops for p in ps), rest_ops, moved)


def unit_costs(summary: StepSummary, candidate: Candidate, cost: CostInputs) -> list[UnitCost]:
    out = []
    for u, span in enumerate(candidate.spans(len(summary.pieces))):
        ps = [summary.pieces[i] for i in span]
        every = sum(p.activation_bytes for p in ps)
        kept, recompute_s = kept_and_recompute(summary, span, candidate.level_of(u), cost)
        gathered, grads = sum(p.gathered_bytes for p in ps), sum(p.grad_bytes for p in ps)
        shard = sum(p.shard_bytes for p in ps)
        ops = EXECUTED_OPS_PER_TRACE_OP * sum(p.ops for p in ps)
        # at every world size, one rank included: the traces gather and reduce-scatter there too (each a copy,
        # the link costing nothing), and pack and unpack around them
        reduces = 1 + int(summary.replicas > 1)  # a reduce-scatter, HSDP's all-reduce
        out.append(
            UnitCost(
                gathered,
                grads,
                shard,
                kept,
                cost.compute_seconds(sum(p.flops for p in ps), ops, sum(p.moved_bytes for p in ps)),
                cost.link.seconds(gathered, summary.ranks, ALL_GATHER),
                cost.link.seconds(grads, summary.ranks, REDUCE_SCATTER) + _across_replicas_s(summary, grads, cost),
                # packing copies the shards into the send buffer, unpacking the gathered rows out of it
                cost.compute_seconds(0, OPS_PER_COLLECTIVE, 2 * (shard + gathered)),
                cost.compute_seconds(0, OPS_PER_COLLECTIVE * reduces, 2 * (grads + shard)),
                _working(ps, summary.fused),
                every - kept,
                recompute_s,
                any(p.backward_reads_params for p in ps),
                sum(p.compute_grad_bytes or p.grad_bytes for p in ps),
            )
        )
    return out


def _working(ps, fused: bool = False) -> int:
    """The most a unit's backward holds beyond all of its activations (kept and recomputed): walking its pieces
    last first, each piece's working set (:data:`WORKING_RESULTS` times its largest result, or an attention's
    score gradients) while its own and its earlier pieces' activations are live, the later pieces' freed. Under
    fusion (``fused``) :data:`FUSED_WORKING_RESULTS` times its largest result, and the parameter gradients its
    own and the later pieces' backward made, which live until the unit's end packs them."""
    every = sum(p.activation_bytes for p in ps)
    live, most, grads = every, 0, 0
    results = FUSED_WORKING_RESULTS if fused else WORKING_RESULTS
    for p in reversed(ps):
        grads += (p.compute_grad_bytes or p.grad_bytes) if fused else 0
        piece = max(results * p.largest_result_bytes, SCORE_GRADIENTS * p.scores_bytes) + grads
        most = max(most, live + piece - every)
        live -= p.activation_bytes
    return most


def _across_replicas_s(summary: StepSummary, grads: int, cost: CostInputs) -> float:
    """HSDP: the all-reduce of a unit's reduced gradient shard (``grads`` / ranks) across the replicas, which
    the backward issues right after its reduce-scatter, on the same queue."""
    if summary.replicas <= 1:
        return 0.0
    return cost.across_replicas.seconds(grads / max(summary.ranks, 1), summary.replicas, ALL_REDUCE)


def _host_copy_s(nbytes: int, cost: CostInputs, offload: bool) -> float:
    if not offload:
        return 0.0
    return nbytes / cost.host_bytes_per_s if cost.host_bytes_per_s else 0.0


def _issue_anchors(seq: list[int], candidate: Candidate) -> list[int]:
    """For the gathers ``seq`` (unit indices, in the order a trace uses them): after the wait of which gather
    each is issued, as the schedule does: ``t - depth`` of its unit (-1: at the top of the trace), or ``t`` itself
    for depth 0 (right before its own wait)."""
    return [max(t - candidate.depth_of(u), -1) if candidate.depth_of(u) > 0 else t for t, u in enumerate(seq)]


def _gather_orders(candidate: Candidate, units: list[UnitCost]) -> tuple[list[int], list[int], list[int], list[int]]:
    """(forward gathers, their anchors, backward gathers, their anchors). The forward gathers every unit; the
    leading units kept for the backward are all issued at the top (``Schedule.kept_units_first``). The
    backward gathers again the units that resharded and whose backward reads their parameters, last unit first."""
    k = len(units)
    forward = list(range(k))
    anchors = _issue_anchors(forward, candidate)
    for t in range(k):
        if candidate.reshard[t]:
            break
        anchors[t] = -1
    backward = [j for j in range(k - 1, -1, -1) if units[j].gathered_again(candidate.reshard[j])]
    return forward, anchors, backward, _issue_anchors(backward, candidate)


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
    forward, f_anchor, backward, b_anchor = _gather_orders(candidate, units)
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
    reduced = 0  # the gradient shards the backward has made so far
    for j in range(k - 1, -1, -1):
        gathered = units[j].gathered  # kept since its forward, or gathered again
        if not candidate.reshard[j]:
            kept -= units[j].gathered
        elif units[j].reads_params:
            latest_wait += 1
        else:
            gathered = 0
        ahead = b_unused[latest_wait + 1]
        in_flight = sum(u.grads for u in units[j + 1 : j + 1 + REDUCE_SCATTERS_IN_FLIGHT])
        common = persistent + reduced + kept + ahead + in_flight + output_grad
        # its backward starts with its parameters gathered, its activations kept and the gradients of its largest
        # results being made, and ends with its gradients packed for the reduce-scatter, the rest freed: each op
        # of it that makes a gradient frees what it read
        start = gathered + acts + units[j].recomputed + units[j].working
        made = units[j].compute_grads or units[j].grads  # its gradients, then their copy packed for the reduce
        live = common + max(start, acts - units[j].activations + made + units[j].grads)
        if live > best:
            best, where = live, f"backward of {names[j]}"
        acts -= units[j].activations
        reduced += 0 if candidate.offload else units[j].shard
    if persistent + reduced > best:
        best, where = persistent + reduced, "optimizer step"
    return best, where


def persistent_bytes(summary: StepSummary, offload: bool) -> int:
    """What lives on the device between steps: the shards and their optimizer states (none offloaded)."""
    return 0 if offload else summary.state_bytes


def predict(summary: StepSummary, candidate: Candidate, cost: CostInputs, names: list[str] | None = None) -> Prediction:
    units = unit_costs(summary, candidate, cost)
    names = names or [summary.pieces[s.start].name for s in candidate.spans(len(summary.pieces))]
    persistent = persistent_bytes(summary, candidate.offload)
    peak, where = peak_of(units, candidate, names, persistent, summary.output_bytes)
    optimizer = optimizer_seconds(summary, cost)
    return Prediction(
        _step_seconds(units, candidate, cost) + optimizer, compute_seconds(units, candidate), peak, where,
        persistent, optimizer,
    )
