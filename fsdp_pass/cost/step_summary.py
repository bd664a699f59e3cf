"""What the auto planner knows of a step: the model cut into *pieces* along the trace, each with its bytes,
its FLOPs and its activations. ``summarize(computation, inp, sharding, precision) -> StepSummary``.

A piece is the smallest group of parameters the planner places: a repeated block's direct child (a
decoder layer's attention, its MLP, each of its norms), or, outside the blocks, one module's parameters.
Pieces are ordered by first use in the forward trace; a unit the planner makes is a run of consecutive
pieces, so it can merge blocks (``layers.3`` with ``layers.4``) or split one (its attention from its MLP).

Read off the functional forward trace, before any rewriting (items 3 to 5 in one walk over its ops,
:mod:`~fsdp_pass.cost.op_tally`):

1. ``gathered_bytes``: the piece's unsharded parameters as the step holds them once gathered, in the dtype it
   computes in (the mixed precision's ``param_dtype``, else their own); ``sent_bytes`` as its gather moves them
   (the same, but for an 8-bit gather: codes and scales, ``MixedPrecision.sent_nbytes``, whose buffer is held too,
   from the gather's issue to its dequantize); ``grad_bytes`` the parameters in the dtype they are reduced in.
2. ``shard_bytes``: what this rank keeps of them between steps (padding included).
3. ``flops``: the forward ops between this piece's first parameter read and the next piece's, counted by
   :func:`~fsdp_pass.cost.op_flops.estimated_flops` (matmuls 2·m·n·k, attention 4·b·h·s²·d, about half that
   when causal and run as one kernel, others one per output element).
4. ``activation_bytes``: what the backward keeps of those ops, as Thunder's autodiff keeps it
   (:mod:`~fsdp_pass.cost.saved_tensors`: each op differentiated alone): the results it keeps, each charged
   to the piece whose op made it (a view to what it views), and the intermediates of the decompositions it
   differentiates through (a tanh GELU's, a layer norm's, an attention's scores where no executor runs it as
   one kernel with a backward of its own: torch's SDPA on CUDA keeps a log-sum-exp per row, left out).
   ``matmul_activation_bytes`` the part that matmuls and attentions make (what selective checkpointing keeps),
   ``read_later`` the results that later pieces read, and the kept ones that the ops after the piece's last
   parameter read make or read (a residual add after the last matmul, the next norm's reduction: outside what a
   checkpointed unit recomputes), which a checkpointed unit keeps. On a fusion executor (the CUDA lowering) the
   elementwise chains keep their inputs instead, region by region (:mod:`~fsdp_pass.cost.fused_saves`), and
   selective checkpointing keeps what the chains through the copies start from too (the fused kernels recompute
   the ops between the matmuls at both levels; the selective level the copies as well: grouped-query attention's
   k and v projections, not their repeated copies), ``matmul_read_later`` the part of ``read_later`` it counts.
   ``backward_reads_params``: whether its ops keep one of its parameters (or a tied one's) for the backward
   (else its unit is not gathered again); ``compute_grad_bytes`` its gradients in the gathered dtype.
   ``scores_bytes``: an attention computed op by op, its scores (its backward makes two gradients as large).
   ``freed_in``: its kept results whose backward is a later piece's (kept first by that piece's ops, or by ops
   after this piece's last parameter read, whose backward runs before this piece's unit is gathered again), which
   frees them; ``passed_on``: its results that later pieces read and that need a gradient (unfused lists only).
   The dry run's traced peak (``explain()``) is the check.

5. ``ops``: those ops, counted as the functional trace has them (the executed trace has about twice as many:
   views, re-layouts; :mod:`~fsdp_pass.cost.step_model` scales them), ``matmul_ops`` and ``matmul_flops`` the
   matmuls' and attentions' part; ``moved_bytes``: what the ops that are
   neither matmuls nor views read and write (elementwise ops, reductions, normalizations), their tensors' bytes;
   ``largest_result_bytes``: the largest floating-point result of those ops that the forward does not return, a
   loss it computes left out (item 6) (the
   backward's working set is counted in these: the gradient an op receives, the one it makes, a temporary; the
   returned results' gradients are item 6's).

6. ``output_bytes`` (of the whole step): the forward's floating-point results, whose gradients the backward
   receives and frees once the last unit's ops have read them (the logits, when the loss is computed outside the
   model; a scalar when it is inside). ``loss_bytes``: what a loss the caller computes on those outputs holds at
   the backward's start (:func:`caller_loss_bytes`, the memory report's rule 6; 0 where
   the forward returns its own loss). Where it does (unfused lists), ``tail_largest_bytes`` and
   ``tail_activation_bytes``: the largest result of the ops after the forward's last parameter read, and what they
   keep: the loss's backward, which runs before the last unit's.

7. ``replicas`` (of the whole step): under HSDP, how many copies of the shard group all-reduce each reduced
   gradient shard (``ranks`` is the shard group's size).

8. ``gathers_views`` (of the whole step): whether a unit's gather is its shards themselves, views and no copy
   (:func:`~fsdp_pass.plan.gather_rules.gathers_nothing`: a shard group of one rank, no parameter cast by mixed precision,
   no quantized gather; offload, a candidate's choice, copies them all the same).

9. ``quantized`` (of the whole step): the gathers are 8-bit (``MixedPrecision.gather_dtype``): each holds its
   received codes beside the dequantized parameters at its dequantize.

10. ``after_last_read`` (of the whole step): per parameter, the bytes the forward computes after its last read
   (:func:`~fsdp_pass.plan.computed_after.bytes_after_last_read`): ZeRO-3's last-unit rule where the step model
   cannot price the units (:func:`~fsdp_pass.plan.plan_units.keeps_last_unit`) reads them here, from the summary
   every rank plans from (:mod:`~fsdp_pass.search.planned_from`), not from a rank's own trace.

No process group, no tensors: a pure function of the trace, the sharding plan and which attentions run fused
(``fused_attention(bsym)``), so the planner can be tested on hand-made summaries.
"""

from __future__ import annotations

from dataclasses import dataclass

from thunder.core.proxies import TensorProxy
from thunder.core.pytree import tree_flatten

from fsdp_pass.plan.gather_rules import gathers_nothing
from fsdp_pass.plan.computed_after import bytes_after_last_read
from fsdp_pass.plan.mixed_precision import MixedPrecision, thunder_dtype
from fsdp_pass.cost.op_tally import ops_by_piece, tensor_bytes
from fsdp_pass.plan.optimizers import ADAMW, Optimizer
from fsdp_pass.plan.sharding import ShardingPlan
from fsdp_pass.plan.unit_policies import Blocks, PolicyInput
from fsdp_pass.predicates import is_float_tensor, is_return
from fsdp_pass.plan.caller_loss import caller_loss


@dataclass(frozen=True)
class Piece:
    name: str
    params: tuple[str, ...]
    block: str  # the Blocks unit it belongs to: where the planner starts from
    gathered_bytes: int  # unsharded, as held once gathered (in the compute dtype)
    grad_bytes: int  # unsharded gradients, in the reduce dtype
    shard_bytes: int  # this rank's shards, in their stored dtype (padding included)
    flops: float  # forward
    activation_bytes: int  # what the forward keeps for the backward (an upper bound)
    ops: int = 0  # forward ops of the functional trace
    moved_bytes: int = 0  # bytes the forward's elementwise ops read and write
    largest_result_bytes: int = 0  # the largest floating-point result of one of its ops, not returned
    matmul_flops: float = 0.0  # the part of ``flops`` its matmuls and attentions compute
    matmul_ops: int = 0  # the part of ``ops`` they are
    matmul_activation_bytes: int = 0  # the part of ``activation_bytes`` they make (what selective checkpointing keeps)
    # (the last piece that reads them, bytes): its results read by later pieces, which a checkpointed unit keeps
    read_later: tuple[tuple[int, int], ...] = ()
    scores_bytes: int = 0  # the largest b·h·s·s scores of an attention computed op by op (its backward's working set)
    # (the last piece that reads them, bytes): the part of ``read_later`` that ``matmul_activation_bytes`` counts too
    matmul_read_later: tuple[tuple[int, int], ...] = ()
    # whether its ops keep one of its parameters for the backward (else a resharded unit of such pieces is not
    # gathered again: an embedding's gradient reads its indices only)
    backward_reads_params: bool = True
    # its unsharded gradients as the backward makes them, in the gathered dtype (0: ``grad_bytes``), before they are
    # packed in the reduce dtype
    compute_grad_bytes: int = 0
    # (a later piece, bytes): its kept results whose earliest keeper is that later piece (a block's output, which the
    # next norm keeps): that piece's backward reads them last and frees them (item 4)
    freed_in: tuple[tuple[int, int], ...] = ()
    # (the last piece that reads them, bytes): its results that later pieces read and that need a gradient (a block's
    # output): the gradient its backward receives from theirs
    passed_on: tuple[tuple[int, int], ...] = ()
    # unsharded, as its gather sends them (an 8-bit gather's codes and scales); 0: ``gathered_bytes``
    sent_bytes: int = 0


@dataclass(frozen=True)
class StepSummary:
    pieces: tuple[Piece, ...]
    ranks: int  # of the shard group
    optimizer: Optimizer = ADAMW  # what steps the shards: its states per element and its time (plan.optimizers)
    output_bytes: int = 0  # the forward's floating-point results: their gradients live through the last unit's backward
    replicas: int = 1  # HSDP: copies of the shard group; each reduced gradient shard is all-reduced across them
    fused: bool = False  # a fusion executor runs the elementwise ops (the CUDA lowering): step_model's working set
    loss_bytes: int = 0  # what the caller's loss on the outputs holds at the backward's start (item 6)
    gathers_views: bool = False  # a unit's gather is its shards themselves (item 8): one rank, nothing cast
    # a loss the forward computes after its last parameter read (item 6): its largest result and what it keeps
    tail_largest_bytes: int = 0
    tail_activation_bytes: int = 0
    quantized: bool = False  # 8-bit gathers (item 9): each piece's ``sent_bytes`` is its received codes and scales
    # (parameter, bytes): what the forward computes after the parameter's last read (item 10)
    after_last_read: tuple[tuple[str, int], ...] = ()

    @property
    def shard_bytes(self) -> int:
        return sum(p.shard_bytes for p in self.pieces)

    @property
    def optimizer_states(self) -> int:
        """Parameter-sized optimizer states per trainable element (AdamW: 2)."""
        return self.optimizer.states

    @property
    def state_bytes(self) -> int:
        """This rank's shards and their optimizer state: what lives between steps whose gradients are freed."""
        return self.shard_bytes * (1 + self.optimizer_states)

    @property
    def activation_bytes(self) -> int:
        return sum(p.activation_bytes for p in self.pieces)

    def bytes_after(self, params) -> int | None:
        """What the forward computes after the last read of any of ``params`` (item 9); None where it read none."""
        after = dict(self.after_last_read)
        known = [after[p] for p in params if p in after]
        return min(known) if known else None

    @property
    def tensors(self) -> int:
        """Parameter tensors: what a per-tensor optimizer steps one by one."""
        return sum(len(p.params) for p in self.pieces)


def _piece_key(param: str, block: str, inp: PolicyInput) -> str:
    """The piece a parameter belongs to: the block's direct child holding it, else its own module."""
    module = inp.tree.module_of_param(param) or param
    if block in inp.tree.params and module != block and module.startswith(block + "."):
        child = module[len(block) + 1 :].split(".")[0]
        return f"{block}.{child}"
    return module


def _pieces_of(inp: PolicyInput) -> list[tuple[str, str, list[str]]]:
    """(piece name, block, parameter names) in order of first use."""
    pieces: dict[str, tuple[str, list[str]]] = {}
    for block, params in Blocks().groups(inp):
        for p in params:
            pieces.setdefault(_piece_key(p, block, inp), (block, []))[1].append(p)
    out = [(name, block, sorted(ps, key=inp.first_use.get)) for name, (block, ps) in pieces.items()]
    return sorted(out, key=lambda item: inp.first_use[item[2][0]])


def summarize(
    computation,
    inp: PolicyInput,
    param_of_arg: dict[str, str],
    sharding: ShardingPlan,
    precision: MixedPrecision,
    optimizer: Optimizer = ADAMW,
    replicas: int = 1,
    fused_attention=lambda bsym: False,
    fuses: bool = False,
) -> StepSummary:
    """The pieces of the functional forward trace ``computation`` (``inp``: what a unit policy sees of it);
    ``replicas``: HSDP's copies of the shard group (1 without HSDP); ``fused_attention(bsym)``: whether an
    executor runs that attention as one kernel (item 4)."""
    found = _pieces_of(inp)
    index_of_param = {p: i for i, (_, _, ps) in enumerate(found) for p in ps}
    piece_of_arg = {a: index_of_param[p] for a, p in param_of_arg.items() if p in index_of_param}
    outputs = returned_outputs(computation)  # their gradients are the step's output_bytes, not a piece's working set
    blocks = [block for _, block, _ in found]  # under fusion, a block's kernels are a region (fused_saves)
    t = ops_by_piece(computation, piece_of_arg, len(found), fused_attention, frozenset(o.name for o in outputs),
                      fuses, blocks.__getitem__)

    reads_params = _reads_params_with_tied_owners(t.reads_params, found, index_of_param, sharding)
    pieces = _pieces(found, t, reads_params, sharding, precision)
    cast = [p for _, _, ps in found for p in ps if precision.param_dtype not in (None, sharding.param(p).dtype)]
    views = gathers_nothing(sharding.world_size, bool(cast) or precision.gather_dtype is not None, False)
    return StepSummary(pieces, sharding.world_size, optimizer, tensor_bytes(outputs), replicas, fuses,
                       caller_loss_bytes(computation, param_of_arg, precision), views,
                       tail_largest_bytes=t.tail_largest, tail_activation_bytes=t.tail_acts,
                       quantized=precision.gather_dtype is not None,
                       after_last_read=bytes_after_last_read(computation, param_of_arg))


def _reads_params_with_tied_owners(reads, found, index_of_param, sharding: ShardingPlan) -> list:
    """Whether each piece reads its parameters, where a tied parameter's reads are its owner's (a tied head's
    backward reads the embedding's weight, which the embedding's unit gathers): a piece reading its tied parameters
    marks their owners' pieces too."""
    reads_params = list(reads)
    for i, (_, _, params) in enumerate(found):
        for p in params if reads[i] else ():
            if sharding.param(p).shard_of in index_of_param:
                reads_params[index_of_param[sharding.param(p).shard_of]] = 1
    return reads_params


def _pieces(found, t, reads_params, sharding: ShardingPlan, precision: MixedPrecision) -> tuple[Piece, ...]:
    """One ``Piece`` per ``(name, block, params)`` of ``found``, from the op tally ``t``."""

    def nbytes(params, dtype) -> int:
        return sum(sharding.param(p).nbytes(dtype) for p in params)

    return tuple(
        Piece(
            name,
            tuple(params),
            block,
            sum(precision.held_nbytes(sharding.param(p)) for p in params),
            nbytes(params, precision.reduce_dtype),
            sum(sharding.param(p).layout.shard_numel * sharding.param(p).itemsize for p in params),
            t.flops[i],
            t.acts[i],
            t.ops[i],
            t.moved[i],
            t.largest[i],
            t.matmul_flops[i],
            t.matmul_ops[i],
            min(t.matmul_acts[i], t.acts[i]),
            tuple(sorted(t.escaping[i].items())),
            t.scores[i],
            tuple(sorted(t.matmul_escaping[i].items())),
            bool(reads_params[i]),
            nbytes(params, precision.param_dtype),
            tuple(sorted(t.freed_in[i].items())),
            tuple(sorted(t.passed_on[i].items())),
            sum(precision.sent_nbytes(sharding.param(p)) for p in params),  # 8-bit: codes and scales
        )
        for i, (name, block, params) in enumerate(found)
    )


def returned_outputs(computation) -> list[TensorProxy]:
    """The floating-point tensors the trace returns (under ``"output"`` when it returns a dict)."""
    (ret,) = [b for b in computation.bound_symbols if is_return(b)]
    value = ret.args[0] if ret.args else None
    if isinstance(value, dict) and "output" in value:
        value = value["output"]
    flat, _ = tree_flatten(value)
    return [t for t in flat if is_float_tensor(t)]


def differentiable_outputs(computation, param_of_arg: dict[str, str]) -> list:
    """The floating-point tensors the forward returns (under ``"output"``) that a parameter reaches (or an input
    that requires a gradient): those whose gradients the backward receives."""
    reached = set(param_of_arg) | {a.name for a in computation.args if getattr(a, "requires_grad", False)}
    for b in computation.bound_symbols:
        if not is_return(b) and any(p.name in reached for p in b.flat_proxy_args):
            reached.update(o.name for o in b.flat_proxy_outs if is_float_tensor(o))
    return [o for o in returned_outputs(computation) if o.name in reached]


def caller_loss_bytes(computation, param_of_arg: dict[str, str], precision=None) -> int:
    """What a loss the caller computes on the forward's outputs holds at the backward's start, as the memory model
    prices it (its rule 6, :func:`fsdp_pass.plan.caller_loss.caller_loss`: a cross-entropy's log-probabilities and
    their gradient, two buffers as large as the logits, in the mixed ``precision``'s ``output_dtype``); 0 where the
    forward returns its own loss (a 0-d output with a gradient) or nothing with a gradient."""
    dtype = thunder_dtype(getattr(precision, "output_dtype", None))
    return sum(n for _, n in caller_loss(differentiable_outputs(computation, param_of_arg), dtype))
