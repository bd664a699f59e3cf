"""What each unit of a candidate plan costs on its own: its bytes (gathered, reduced, sharded, kept for the backward,
its backward's working set) and its seconds (forward compute, its collectives on the link and FSDP's ops around them
on the compute queue, a checkpointed unit's recompute). ``unit_costs(summary, candidate, cost) -> list[UnitCost]``.

A :class:`Candidate` is what the planner decides: the units (runs of consecutive pieces of a
:class:`~fsdp_pass.cost.step_summary.StepSummary`), which of them reshard after forward, the prefetch depth (one for
all, or one per unit), offload, checkpointing. :mod:`~fsdp_pass.cost.step_model` runs the units' costs through the
step's two queues and its memory; its docstring says how each cost is priced.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_pass.op_names import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from fsdp_pass.plan.gather_rules import unpack_is_view
from fsdp_pass.plan.checkpointing import FULL, NONE
from fsdp_pass.cost.cost_model import CostInputs
from fsdp_pass.cost.step_summary import StepSummary

# ops the torch executor runs per op of the functional trace (views, re-layouts and decompositions added): the
# benchmark model's forward, 136 traced ops run as 259 (backward 544, about twice), `scratch` count of
# thunder.last_traces, 2026-11-25
EXECUTED_OPS_PER_TRACE_OP = 1.9
# FSDP's own ops per collective on the compute queue: pack, the collective, its wait, unpack (the final traces)
OPS_PER_COLLECTIVE = 4
# the backward's working set beside the gradient a unit receives, in a unit's largest forward result: the gradient
# an op makes from the one it received. On the unfused lists each op's backward frees the saved activations it read
# as it makes the next gradients, so the trace never holds more: the zoo Llama's layer 7 backward (d 512, CPU, world
# 2) holds its output's gradient (1 MiB) and one MLP-hidden gradient (2.7 MiB) above its start, nothing more (the
# traces, 2026-11-26). Was 3 with the received gradient in it: the loss's backward (logits', log-softmax's, nll's)
# before the outputs' gradients and the loss's were counted apart.
WORKING_RESULTS = 1
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
    # over a group of one rank the reduce-scatter returns its input: the buffer it holds is the gradient shard
    # (``shard``), and nothing else is in flight until its wait
    reduced_in_place: bool = False
    # the gradient its backward receives from the later units': the largest of its results they read (the ops after
    # its last parameter read, a residual add, the next norm's reduction, sum them into one before it is gathered)
    received: int = 0
    # (a later unit, bytes): its kept activations whose earliest keeper is that unit, whose backward frees them
    freed_later: tuple[tuple[int, int], ...] = ()
    copies_out: bool = False  # its unpack copies the parameters out of the gathered buffer (more than one parameter)
    # the last unit only: a loss the forward computes after its last parameter read, whose backward runs before the
    # unit's own: its working set (the gradient an op receives and the one it makes, each as large as the loss's
    # largest result) and the activations it frees
    tail_working: int = 0
    tail_activations: int = 0
    # an 8-bit gather: its gathered buffer of codes and scales (what it sends), held from its issue until its dequantize
    # has read it, beside the dequantized parameters (``gathered``) there; 0: not quantized
    codes: int = 0

    @property
    def in_flight(self) -> int:
        """Bytes its gather holds from its issue until its wait is used: the codes, else the gathered buffer."""
        return self.codes or self.gathered

    def forward_total_s(self) -> float:
        return self.forward_s + self.gather_ops_s

    def gathered_again(self, reshards: bool) -> bool:
        return reshards and self.reads_params

    def backward_total_s(self, reshards: bool) -> float:
        again = self.gathered_again(reshards)
        return 2 * self.forward_s + self.recompute_s + self.reduce_ops_s + (self.gather_ops_s if again else 0.0)


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
    spans = candidate.spans(len(summary.pieces))
    unit_of = {i: u for u, span in enumerate(spans) for i in span}
    for u, span in enumerate(spans):
        ps = [summary.pieces[i] for i in span]
        every = sum(p.activation_bytes for p in ps)
        kept, recompute_s = kept_and_recompute(summary, span, candidate.level_of(u), cost)
        # the gradient its backward receives (unfused: under fusion the largest result's gradient stands for it)
        passed_on = [b for p in ps for reader, b in p.passed_on if reader >= span.stop]
        received = 0 if summary.fused else max([0, *passed_on])
        gathered, grads = sum(p.gathered_bytes for p in ps), sum(p.grad_bytes for p in ps)
        sent = sum(p.sent_bytes or p.gathered_bytes for p in ps)  # an 8-bit gather's codes and scales
        codes = sent if summary.quantized else 0
        shard = sum(p.shard_bytes for p in ps)
        ops = EXECUTED_OPS_PER_TRACE_OP * sum(p.ops for p in ps)
        # a gather that is the shards themselves (one rank, nothing cast or moved): views, no bytes, one op each
        views = summary.gathers_views and not candidate.offload
        # packing (an 8-bit gather: quantizing) reads the shards, unpacking copies the gathered rows out (dequantizing
        # first reads the codes and writes the gathered buffer)
        gather_ops_s = (cost.compute_seconds(0, sum(len(p.params) for p in ps), 0) if views else
                        cost.compute_seconds(0, OPS_PER_COLLECTIVE + bool(codes),
                                             2 * (shard + gathered) + (codes + gathered if codes else 0)))
        gathered, sent = (0, 0) if views else (gathered, sent)
        # at every world size, one rank included, the traces reduce-scatter (over one rank it returns its input) with
        # pack and unpack around it; they gather there too, pack, copy and unpack, except where the gather is the
        # shards' views (``views`` above)
        reduces = 1 + int(summary.replicas > 1)  # a reduce-scatter, HSDP's all-reduce
        out.append(
            UnitCost(
                gathered,
                grads,
                shard,
                kept,
                cost.compute_seconds(sum(p.flops for p in ps), ops, sum(p.moved_bytes for p in ps)),
                cost.link.seconds(sent, summary.ranks, ALL_GATHER),
                cost.link.seconds(grads, summary.ranks, REDUCE_SCATTER) + _across_replicas_s(summary, grads, cost),
                # packing copies the shards into the send buffer, unpacking the gathered rows out of it
                gather_ops_s,
                cost.compute_seconds(0, OPS_PER_COLLECTIVE * reduces, 2 * (grads + shard)),
                _working(ps, summary.fused, received),
                every - kept,
                recompute_s,
                any(p.backward_reads_params for p in ps),
                sum(p.compute_grad_bytes or p.grad_bytes for p in ps),
                summary.ranks == 1,
                received,
                _freed_later(ps, unit_of, u) if candidate.level_of(u) == NONE else (),
                not unpack_is_view(sum(len(p.params) for p in ps)),
                2 * summary.tail_largest_bytes if span.stop == len(summary.pieces) else 0,
                summary.tail_activation_bytes if span.stop == len(summary.pieces) else 0,
                codes,
            )
        )
    return out


def _freed_later(ps, unit_of: dict[int, int], u: int) -> tuple[tuple[int, int], ...]:
    """(a later unit, bytes) of the activations of pieces ``ps`` (unit ``u``'s) whose earliest keeper is in it."""
    later: dict[int, int] = {}
    for p in ps:
        for keeper, b in p.freed_in:
            if unit_of.get(keeper, u) > u:
                later[unit_of[keeper]] = later.get(unit_of[keeper], 0) + b
    return tuple(sorted(later.items()))


def _working(ps, fused: bool = False, received: int = 0) -> int:
    """The most a unit's backward holds beyond all of its activations (kept and recomputed): walking its pieces
    last first, each piece's working set (:data:`WORKING_RESULTS` times its largest result, or an attention's
    score gradients; the last piece's beside the gradient the unit ``received``, which its first op reads and
    frees) while its own and its earlier pieces' activations are live, the later pieces' freed. Under
    fusion (``fused``) :data:`FUSED_WORKING_RESULTS` times its largest result, and the parameter gradients its
    own and the later pieces' backward made, which live until the unit's end packs them."""
    every = sum(p.activation_bytes for p in ps)
    live, most, grads = every, 0, 0
    results = FUSED_WORKING_RESULTS if fused else WORKING_RESULTS
    for p in reversed(ps):
        grads += (p.compute_grad_bytes or p.grad_bytes) if fused else 0
        piece = max(results * p.largest_result_bytes, SCORE_GRADIENTS * p.scores_bytes) + grads + received
        most = max(most, live + piece - every)
        live -= p.activation_bytes
        received = 0
    return most


def _across_replicas_s(summary: StepSummary, grads: int, cost: CostInputs) -> float:
    """HSDP: the all-reduce of a unit's reduced gradient shard (``grads`` / ranks) across the replicas, which
    the backward issues right after its reduce-scatter, on the same queue."""
    if summary.replicas <= 1:
        return 0.0
    return cost.across_replicas.seconds(grads / max(summary.ranks, 1), summary.replicas, ALL_REDUCE)
