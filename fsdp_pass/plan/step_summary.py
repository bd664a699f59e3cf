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
   :func:`~fsdp_pass.plan.op_flops.estimated_flops` (matmuls 2·m·n·k, attention 4·b·h·s²·d, others one
   per output element).
4. ``activation_bytes``: those ops' results that a later op needs for its own gradient (a matmul's input,
   a product's factor, a normalization's or an activation function's input), views and results read only
   by sums, copies and re-layouts left out: an estimate of what the backward keeps (Thunder's autodiff may
   save other tensors, fusion recomputes some). An attention that no executor runs as one kernel with a
   backward of its own is computed op by op, and keeps b·h·s_q·s_k scores twice (the softmax's input and
   output) and its mask; a fused kernel (torch's SDPA on CUDA) keeps a log-sum-exp per row, left out. The dry run's
   traced peak (``explain()``) is the check on it.

5. ``ops``: those ops, counted as the functional trace has them (the executed trace has about twice as many:
   views, re-layouts; :mod:`~fsdp_pass.plan.step_model` scales them); ``moved_bytes``: what the ops that are
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

from fsdp_pass.plan.mixed_precision import MixedPrecision
from fsdp_pass.plan.op_flops import estimated_flops, is_attention, is_matmul_like
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


@dataclass(frozen=True)
class StepSummary:
    pieces: tuple[Piece, ...]
    ranks: int  # of the shard group
    optimizer_states: int = 2  # parameter-sized optimizer states per trainable element (Adam: 2)
    output_bytes: int = 0  # the forward's floating-point results: their gradients live through the backward
    replicas: int = 1  # HSDP: copies of the shard group; each reduced gradient shard is all-reduced across them

    @property
    def shard_bytes(self) -> int:
        return sum(p.shard_bytes for p in self.pieces)

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


# ops whose gradient does not read their tensor inputs: a result read only by these is not kept for the backward
_GRADIENT_NEEDS_NO_INPUT = frozenset(
    ("add", "sub", "neg", "cat", "reshape", "view", "permute", "transpose", "contiguous", "unsqueeze", "squeeze",
     "expand", "flatten", "getitem", "split", "chunk", "slice", "to", "type_as", "clone", "sum", "mean",
     "python_return", "return", "broadcast_in_dim", "convert_element_type")
)


def _tensor_bytes(proxies) -> int:
    return sum(int(p.numel) * p.dtype.bytes for p in proxies if getattr(p, "shape", None) is not None)


def attention_scores_bytes(bsym) -> int:
    """What an attention computed op by op keeps for its backward besides its inputs and output: its scores
    before and after the softmax, b·h·s_q·s_k each in the query's dtype, and for a causal or masked one the
    mask broadcast to them, a byte each."""
    args = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal"), bsym.args), **bsym.kwargs)
    q, k = args["query"], args["key"]
    scores = (int(q.numel) // int(q.shape[-1])) * int(k.shape[-2])
    masked = args.get("is_causal") or args.get("attn_mask") is not None
    return scores * (2 * q.dtype.bytes + (1 if masked else 0))


def _ops_by_piece(computation, piece_of_arg: dict[str, int], n: int, fused_attention=lambda bsym: False,
                  outputs: frozenset[str] = frozenset()):
    """FLOPs, kept result bytes, op counts, elementwise bytes moved and largest results (``outputs``, the names the
    forward returns, left out) of the forward's ops, each charged to the piece whose parameter the trace read last
    before it."""
    flops, acts, ops, moved, largest = [0.0] * n, [0] * n, [0] * n, [0] * n, [0] * n
    if n == 0:  # a model without parameters: no piece to charge
        return flops, acts, ops, moved, largest
    readers: dict[str, int] = {}  # results read by an op whose gradient needs them
    for bsym in computation.bound_symbols:
        if str(bsym.sym.name) not in _GRADIENT_NEEDS_NO_INPUT and not is_view_like(bsym):
            for p in bsym.flat_proxy_args:
                readers[p.name] = readers.get(p.name, 0) + 1
    current = 0
    for bsym in computation.bound_symbols:
        if is_return(bsym) or is_bookkeeping(bsym):
            continue
        read = [piece_of_arg[p.name] for p in bsym.flat_proxy_args if p.name in piece_of_arg]
        if read:
            current = max(read)
        flops[current] += estimated_flops(bsym)
        ops[current] += 1
        if not is_view_like(bsym):
            acts[current] += _tensor_bytes(o for o in bsym.flat_proxy_outs if readers.get(o.name, 0) > 0)
            if is_attention(bsym) and not fused_attention(bsym):
                acts[current] += attention_scores_bytes(bsym)
            if not is_matmul_like(bsym):
                moved[current] += _tensor_bytes(bsym.flat_proxy_args) + _tensor_bytes(bsym.flat_proxy_outs)
            kept_inside = [o for o in bsym.flat_proxy_outs if is_float_tensor(o) and o.name not in outputs]
            largest[current] = max([largest[current], *(_tensor_bytes((o,)) for o in kept_inside)])
    return flops, acts, ops, moved, largest


def summarize(
    computation,
    inp: PolicyInput,
    param_of_arg: dict[str, str],
    sharding: ShardingPlan,
    precision: MixedPrecision,
    optimizer_states: int = 2,
    replicas: int = 1,
    fused_attention=lambda bsym: False,
) -> StepSummary:
    """The pieces of the functional forward trace ``computation`` (``inp``: what a unit policy sees of it);
    ``replicas``: HSDP's copies of the shard group (1 without HSDP); ``fused_attention(bsym)``: whether an
    executor runs that attention as one kernel (item 4)."""
    found = _pieces_of(inp)
    index_of_param = {p: i for i, (_, _, ps) in enumerate(found) for p in ps}
    piece_of_arg = {a: index_of_param[p] for a, p in param_of_arg.items() if p in index_of_param}
    outputs = _outputs(computation)  # their gradients are the step's output_bytes, not a piece's working set
    flops, acts, ops, moved, largest = _ops_by_piece(computation, piece_of_arg, len(found), fused_attention,
                                                     frozenset(t.name for t in outputs))

    def nbytes(params, dtype) -> int:
        return sum(sharding.param(p).nbytes(dtype) for p in params)

    pieces = tuple(
        Piece(
            name,
            tuple(params),
            block,
            sum(precision.gathered_nbytes(sharding.param(p)) for p in params),  # quantized: codes and scales
            nbytes(params, precision.reduce_dtype),
            sum(sharding.param(p).layout.shard_numel * sharding.param(p).itemsize for p in params),
            flops[i],
            acts[i],
            ops[i],
            moved[i],
            largest[i],
        )
        for i, (name, block, params) in enumerate(found)
    )
    return StepSummary(pieces, sharding.world_size, optimizer_states, _tensor_bytes(outputs), replicas)


def _outputs(computation) -> list[TensorProxy]:
    """The floating-point tensors the trace returns (under ``"output"`` when it returns a dict)."""
    (ret,) = [b for b in computation.bound_symbols if is_return(b)]
    value = ret.args[0] if ret.args else None
    if isinstance(value, dict) and "output" in value:
        value = value["output"]
    flat, _ = tree_flatten(value)
    return [t for t in flat if is_float_tensor(t)]
