"""What the auto planner knows of a step: the model cut into *pieces* along the trace, each with its bytes,
its FLOPs and its activations. ``summarize(computation, inp, sharding, precision) -> StepSummary``.

A piece is the smallest group of parameters the planner places: a repeated block's direct child (a
decoder layer's attention, its MLP, each of its norms), or, outside the blocks, one module's parameters.
Pieces are ordered by first use in the forward trace; a unit the planner makes is a run of consecutive
pieces, so it can merge blocks (``layers.3`` with ``layers.4``) or split one (its attention from its MLP).

Read off the functional forward trace, before any rewriting:

1. ``gathered_bytes``: the piece's unsharded parameters in the dtype they are gathered in (the mixed
   precision's ``param_dtype``, else their own); ``grad_bytes`` the same in the dtype they are reduced in.
2. ``shard_bytes``: what this rank keeps of them between steps (padding included).
3. ``flops``: the forward ops between this piece's first parameter read and the next piece's, counted by
   :func:`~fsdp_pass.plan.op_flops.estimated_flops` (matmuls 2·m·n·k, attention 4·b·h·s²·d, about half that
   when causal and run as one kernel, others one per output element).
4. ``activation_bytes``: what the backward keeps of those ops, as Thunder's autodiff keeps it
   (:mod:`~fsdp_pass.plan.saved_tensors`: each op differentiated alone): the results it keeps, each charged
   to the piece whose op made it (a view to what it views), and the intermediates of the decompositions it
   differentiates through (a tanh GELU's, a layer norm's, an attention's scores where no executor runs it as
   one kernel with a backward of its own: torch's SDPA on CUDA keeps a log-sum-exp per row, left out).
   ``matmul_activation_bytes`` the part that matmuls and attentions make (what selective checkpointing keeps),
   ``read_later`` the results that later pieces read, and the kept ones that the ops after the piece's last
   parameter read make or read (a residual add after the last matmul, the next norm's reduction: outside what a
   checkpointed unit recomputes), which a checkpointed unit keeps. On a fusion executor (the CUDA lowering) the
   elementwise chains keep their inputs instead, region by region (:mod:`~fsdp_pass.plan.fused_saves`), and
   selective checkpointing keeps what the chains through the copies start from too (the fused kernels recompute
   the ops between the matmuls at both levels; the selective level the copies as well: grouped-query attention's
   k and v projections, not their repeated copies), ``matmul_read_later`` the part of ``read_later`` it counts.
   ``backward_reads_params``: whether its ops keep one of its parameters (or a tied one's) for the backward
   (else its unit is not gathered again); ``compute_grad_bytes`` its gradients in the gathered dtype.
   ``scores_bytes``: an attention computed op by op, its scores (its backward makes two gradients as large).
   The dry run's traced peak (``explain()``) is the check.

5. ``ops``: those ops, counted as the functional trace has them (the executed trace has about twice as many:
   views, re-layouts; :mod:`~fsdp_pass.plan.step_model` scales them), ``matmul_ops`` and ``matmul_flops`` the
   matmuls' and attentions' part; ``moved_bytes``: what the ops that are
   neither matmuls nor views read and write (elementwise ops, reductions, normalizations), their tensors' bytes;
   ``largest_result_bytes``: the largest floating-point result of those ops that the forward does not return (the
   backward's working set is counted in these: the gradient an op receives, the one it makes, a temporary; the
   returned results' gradients are item 6's).

6. ``output_bytes`` (of the whole step): the forward's floating-point results, whose gradients the backward
   receives and torch's autograd engine holds until the backward returns (the logits, when the loss is
   computed outside the model; a scalar when it is inside).

7. ``replicas`` (of the whole step): under HSDP, how many copies of the shard group all-reduce each reduced
   gradient shard (``ranks`` is the shard group's size).

No process group, no tensors: a pure function of the trace, the sharding plan and which attentions run fused
(``fused_attention(bsym)``), so the planner can be tested on hand-made summaries.
"""

from __future__ import annotations

from dataclasses import dataclass

from thunder.core.proxies import TensorProxy
from thunder.core.pytree import tree_flatten

from fsdp_pass.plan.fused_saves import is_copy, is_elementwise, kept_after_fusion
from fsdp_pass.plan.mixed_precision import MixedPrecision
from fsdp_pass.plan.optimizers import ADAMW, Optimizer
from fsdp_pass.plan.op_flops import estimated_flops, is_attention, is_matmul_like
from fsdp_pass.plan.saved_tensors import Saved, saved_by_op
from fsdp_pass.plan.sharding import ShardingPlan
from fsdp_pass.plan.unit_policies import Blocks, PolicyInput
from fsdp_pass.predicates import is_bookkeeping, is_float_tensor, is_return, is_view_like


@dataclass(frozen=True)
class Piece:
    name: str
    params: tuple[str, ...]
    block: str  # the Blocks unit it belongs to: where the planner starts from
    gathered_bytes: int  # unsharded, in the gathered dtype
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


@dataclass(frozen=True)
class StepSummary:
    pieces: tuple[Piece, ...]
    ranks: int  # of the shard group
    optimizer: Optimizer = ADAMW  # what steps the shards: its states per element and its time (plan.optimizers)
    output_bytes: int = 0  # the forward's floating-point results: their gradients live through the backward
    replicas: int = 1  # HSDP: copies of the shard group; each reduced gradient shard is all-reduced across them
    fused: bool = False  # a fusion executor runs the elementwise ops (the CUDA lowering): step_model's working set

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


# ops whose gradient does not read their tensor inputs: where Thunder cannot be asked what an op keeps
# (saved_tensors.saved_by_op gives None), an op not among these is taken to keep its inputs
_GRADIENT_NEEDS_NO_INPUT = frozenset(
    ("add", "sub", "neg", "cat", "reshape", "view", "permute", "transpose", "contiguous", "unsqueeze", "squeeze",
     "expand", "flatten", "getitem", "split", "chunk", "slice", "to", "type_as", "clone", "sum", "mean",
     "python_return", "return", "broadcast_in_dim", "convert_element_type")
)


def _tensor_bytes(proxies) -> int:
    return sum(int(p.numel) * p.dtype.bytes for p in proxies if getattr(p, "shape", None) is not None)


def attention_scores_bytes(bsym, masked: bool = True) -> int:
    """What an attention computed op by op keeps for its backward besides its inputs and output: its
    probabilities, b·h·s_q·s_k in the query's dtype (one tensor, which the traces name twice), and for a causal
    or masked one (``masked``) the mask broadcast to them, a byte each (the fallback where Thunder cannot be
    asked, item 4)."""
    args = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal"), bsym.args), **bsym.kwargs)
    q, k = args["query"], args["key"]
    scores = (int(q.numel) // int(q.shape[-1])) * int(k.shape[-2])
    masked = masked and (args.get("is_causal") or args.get("attn_mask") is not None)
    return scores * (q.dtype.bytes + (1 if masked else 0))


def _kept_by(bsym, fused_attention, needs_grad) -> Saved:
    """What ``bsym`` keeps for the backward: a fused attention its inputs and output; another op what Thunder's
    autodiff keeps of it (:mod:`~fsdp_pass.plan.saved_tensors`); where Thunder cannot be asked, its inputs
    unless its gradient reads none (an attention computed op by op: its scores too)."""
    args = [p for p in bsym.flat_proxy_args if isinstance(p, TensorProxy)]
    outs = [p for p in bsym.flat_proxy_outs if isinstance(p, TensorProxy)]
    if is_attention(bsym) and fused_attention(bsym):
        return Saved(tuple(range(len(args))), tuple(range(len(outs))), 0)
    saved = saved_by_op(bsym, needs_grad)
    if saved is not None:
        return saved
    if str(bsym.sym.name) in _GRADIENT_NEEDS_NO_INPUT:
        return Saved((), (), 0)
    return Saved(tuple(range(len(args))), (), attention_scores_bytes(bsym) if is_attention(bsym) else 0)


@dataclass
class _Tally:
    """Per piece, what the forward's ops add up to (``_ops_by_piece``)."""

    flops: list
    matmul_flops: list
    ops: list
    matmul_ops: list
    moved: list
    largest: list
    acts: list
    matmul_acts: list
    escaping: list  # per piece: {last reading piece: bytes}
    matmul_escaping: list  # per piece: the part of ``escaping`` in ``matmul_acts``
    reads_params: list  # per piece: whether an op keeps one of its parameters for the backward
    scores: list  # per piece: the largest scores of an attention computed op by op


def _ops_by_piece(computation, piece_of_arg: dict[str, int], n: int, fused_attention=lambda bsym: False,
                  outputs: frozenset[str] = frozenset(), fuses: bool = False, region_of=None) -> _Tally:
    """FLOPs, op counts, elementwise bytes moved, largest results (``outputs``, the names the forward returns,
    left out), kept bytes (all, and those matmuls make; ``fuses``: as a fusion executor keeps them,
    :mod:`~fsdp_pass.plan.fused_saves`) and the bytes read after the piece, of the forward's ops, each charged to
    the piece whose parameter the trace read last before it."""
    t = _Tally(*([0] * n for _ in range(12)))
    t.flops, t.matmul_flops = [0.0] * n, [0.0] * n
    t.escaping, t.matmul_escaping = [{} for _ in range(n)], [{} for _ in range(n)]
    if n == 0:  # a model without parameters: no piece to charge
        return t
    made_in: dict[str, int] = {}  # a result's name -> the piece whose op made it
    by_matmul: set[str] = set()
    base: dict[str, str] = {}  # a view's name -> the result it views
    proxy: dict[str, TensorProxy] = {}
    kept: set[str] = set()
    kept_in: dict[str, set[int]] = {}  # a kept result -> the pieces whose ops keep it
    last_read: dict[str, int] = {}
    differentiated: set[str] = set()  # the results that depend on a parameter (the trace marks parameters only)
    elementwise_inputs: dict[str, tuple[str, ...]] = {}  # under fusion: an elementwise op's result -> what it read
    copy_inputs: dict[str, tuple[str, ...]] = {}  # the same for the copies (fused_saves.is_copy: selective only)

    def needs_grad(p) -> bool:
        return bool(p.requires_grad) or p.name in differentiated

    ops = [b for b in computation.bound_symbols if not (is_return(b) or is_bookkeeping(b))]
    last_param_read: dict[int, int] = {}  # a piece -> the last op that reads one of its parameters
    for k, bsym in enumerate(ops):
        for p in bsym.flat_proxy_args:
            if p.name in piece_of_arg:
                last_param_read[piece_of_arg[p.name]] = k
    # a result that an op after its piece's last parameter read makes or reads (the residual add after a block's
    # last matmul, the next norm's reduction): outside the region a checkpointed unit ending there recomputes
    # (passes.checkpoint_units), so kept by it as by an op of a later piece: the piece after the reader's
    trailing: dict[str, int] = {}
    current = 0
    for k, bsym in enumerate(ops):
        read = [piece_of_arg[p.name] for p in bsym.flat_proxy_args if p.name in piece_of_arg]
        if read:
            current = max(read)
        if k > last_param_read.get(current, k):
            for p in (*bsym.flat_proxy_args, *bsym.flat_proxy_outs):
                if isinstance(p, TensorProxy):
                    trailing[base.get(p.name, p.name)] = current + 1
        args = [p for p in bsym.flat_proxy_args if isinstance(p, TensorProxy)]
        for p in args:
            name = base.get(p.name, p.name)
            if name in made_in:
                last_read[name] = max(last_read.get(name, 0), current)
        flops = estimated_flops(bsym, skips_masked=not is_attention(bsym) or fused_attention(bsym))
        matmul = is_matmul_like(bsym)
        t.flops[current] += flops
        t.ops[current] += 1
        if matmul:
            t.matmul_flops[current] += flops
            t.matmul_ops[current] += 1
        outs = [o for o in bsym.flat_proxy_outs if isinstance(o, TensorProxy)]
        if any(needs_grad(p) for p in args):
            differentiated.update(o.name for o in outs if is_float_tensor(o))
        if is_view_like(bsym):
            for o in outs:
                base[o.name] = base.get(args[0].name, args[0].name) if args else o.name
            continue
        for o in outs:
            made_in[o.name], proxy[o.name] = current, o
            if matmul:
                by_matmul.add(o.name)
        if is_attention(bsym) and not fused_attention(bsym):
            t.scores[current] = max(t.scores[current], attention_scores_bytes(bsym, masked=False))
        saved = _kept_by(bsym, fused_attention, needs_grad)
        fused_away = fuses and is_elementwise(bsym)
        # fused, its own intermediates are recomputed (item 4): a dtype conversion of an argument from the argument
        held = (*saved.inputs, *(saved.converted if fused_away else ()))
        keeps = [base.get(args[i].name, args[i].name) for i in held] + [outs[j].name for j in saved.outputs]
        for name in keeps:
            kept.add(name)
            kept_in.setdefault(name, set()).add(current)
        for i in (*saved.inputs, *saved.converted):  # a parameter, or its conversion: read by the backward
            name = base.get(args[i].name, args[i].name)
            if name in piece_of_arg:
                t.reads_params[piece_of_arg[name]] = 1
        if fused_away or (fuses and is_copy(bsym)):
            for o in outs:
                read = tuple(base.get(p.name, p.name) for p in args)
                (elementwise_inputs if fused_away else copy_inputs)[o.name] = read
        t.acts[current] += 0 if fused_away else saved.inside_bytes
        if matmul:
            t.matmul_acts[current] += saved.inside_bytes
        if not matmul:
            t.moved[current] += _tensor_bytes(bsym.flat_proxy_args) + _tensor_bytes(bsym.flat_proxy_outs)
        kept_inside = [o for o in outs if is_float_tensor(o) and o.name not in outputs]
        t.largest[current] = max([t.largest[current], *(_tensor_bytes((o,)) for o in kept_inside)])
    selective = kept & by_matmul  # what the selective level keeps of it: the matmuls' results
    if fuses:
        nbytes = lambda name: _tensor_bytes((proxy[name],))  # noqa: E731
        # the fused kernels recompute the elementwise ops at both levels; the selective level the copies too, so
        # it keeps what the chains through them start from, made by matmuls or not (fused_saves)
        selective = kept_after_fusion(kept, {**elementwise_inputs, **copy_inputs}, made_in, nbytes, region_of, kept_in)
        kept = kept_after_fusion(kept, elementwise_inputs, made_in, nbytes, region_of, kept_in)
        t.matmul_acts = list(t.acts)  # every op's intermediates that are kept (a fused elementwise op's: none)
    for name in kept:
        if name in made_in:
            t.acts[made_in[name]] += _tensor_bytes((proxy[name],))
    for name in selective:
        if name in made_in:
            t.matmul_acts[made_in[name]] += _tensor_bytes((proxy[name],))
    for name, piece in made_in.items():
        reader = max(last_read.get(name, piece), trailing.get(name, piece) if name in kept else piece)
        if reader > piece and is_float_tensor(proxy[name]):
            for escaping in (t.escaping, t.matmul_escaping) if name in selective else (t.escaping,):
                escaping[piece][reader] = escaping[piece].get(reader, 0) + _tensor_bytes((proxy[name],))
    return t


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
    outputs = _outputs(computation)  # their gradients are the step's output_bytes, not a piece's working set
    blocks = [block for _, block, _ in found]  # under fusion, a block's kernels are a region (fused_saves)
    t = _ops_by_piece(computation, piece_of_arg, len(found), fused_attention, frozenset(o.name for o in outputs),
                      fuses, blocks.__getitem__)

    def nbytes(params, dtype) -> int:
        return sum(sharding.param(p).nbytes(dtype) for p in params)

    # a tied parameter's reads are its owner's (a tied head's backward reads the embedding's weight, which the
    # embedding's unit gathers): a piece reading its tied parameters marks their owners' pieces too
    reads_params = list(t.reads_params)
    for i, (_, _, params) in enumerate(found):
        for p in params if t.reads_params[i] else ():
            if sharding.param(p).shard_of in index_of_param:
                reads_params[index_of_param[sharding.param(p).shard_of]] = 1

    pieces = tuple(
        Piece(
            name,
            tuple(params),
            block,
            sum(precision.gathered_nbytes(sharding.param(p)) for p in params),  # quantized: codes and scales
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
        )
        for i, (name, block, params) in enumerate(found)
    )
    return StepSummary(pieces, sharding.world_size, optimizer, _tensor_bytes(outputs), replicas, fuses)


def _outputs(computation) -> list[TensorProxy]:
    """The floating-point tensors the trace returns (under ``"output"`` when it returns a dict)."""
    (ret,) = [b for b in computation.bound_symbols if is_return(b)]
    value = ret.args[0] if ret.args else None
    if isinstance(value, dict) and "output" in value:
        value = value["output"]
    flat, _ = tree_flatten(value)
    return [t for t in flat if is_float_tensor(t)]
