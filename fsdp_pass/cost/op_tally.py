"""Per piece, what the forward's ops add up to: one walk over the functional forward trace that charges each op to
the piece whose parameter the trace read last before it. ``ops_by_piece(computation, piece_of_arg, n) -> Tally``.

For each piece: FLOPs and op counts (all, and the matmuls' and attentions' part), the bytes the elementwise ops move,
the largest result the forward does not return, what the backward keeps (all, and what the selective checkpointing
level keeps; under a fusion executor as :mod:`~fsdp_pass.cost.fused_saves` says), the kept results that later pieces
read, whether the backward reads its parameters, and the scores of an attention computed op by op.
:mod:`~fsdp_pass.cost.step_summary` turns the tally into its pieces; its docstring says what each count means.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from thunder.core.proxies import TensorProxy

from fsdp_pass.cost.fused_saves import is_copy, is_elementwise, kept_after_fusion
from fsdp_pass.cost.op_flops import estimated_flops, is_attention, is_matmul_like
from fsdp_pass.cost.saved_tensors import Saved, saved_by_op
from fsdp_pass.predicates import is_bookkeeping, is_float_tensor, is_return, is_view_like


# ops whose gradient does not read their tensor inputs: where Thunder cannot be asked what an op keeps
# (saved_tensors.saved_by_op gives None), an op not among these is taken to keep its inputs
_GRADIENT_NEEDS_NO_INPUT = frozenset(
    ("add", "sub", "neg", "cat", "reshape", "view", "permute", "transpose", "contiguous", "unsqueeze", "squeeze",
     "expand", "flatten", "getitem", "split", "chunk", "slice", "to", "type_as", "clone", "sum", "mean",
     "python_return", "return", "broadcast_in_dim", "convert_element_type")
)


def tensor_bytes(proxies) -> int:
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
    autodiff keeps of it (:mod:`~fsdp_pass.cost.saved_tensors`); where Thunder cannot be asked, its inputs
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
class Tally:
    """Per piece, what the forward's ops add up to (``ops_by_piece``)."""

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
    # per piece: {later piece: bytes} of its kept results whose backward is a later piece's (the first op keeping
    # them is that piece's, or comes after its own last parameter read), which frees them (unfused only: a fusion
    # executor keeps other tensors)
    freed_in: list = field(default_factory=list)
    # per piece: {last reading piece: bytes} of its results that later pieces read and that need a gradient
    passed_on: list = field(default_factory=list)
    # the ops after the forward's last parameter read (a loss the model computes; unfused only): their largest
    # result (left out of the last piece's ``largest``) and the kept results their backward frees
    tail_largest: int = 0
    tail_acts: int = 0


@dataclass
class _Walk:
    """What the walk over the forward's ops has seen so far, and what it was given."""

    piece_of_arg: dict[str, int]
    fused_attention: object
    outputs: frozenset[str]
    fuses: bool
    made_in: dict[str, int] = field(default_factory=dict)  # a result's name -> the piece whose op made it
    by_matmul: set[str] = field(default_factory=set)
    base: dict[str, str] = field(default_factory=dict)  # a view's name -> the result it views
    proxy: dict[str, TensorProxy] = field(default_factory=dict)
    kept: set[str] = field(default_factory=set)
    kept_in: dict[str, set[int]] = field(default_factory=dict)  # a kept result -> the pieces whose ops keep it
    freed_by: dict[str, int] = field(default_factory=dict)  # a kept result -> the piece whose backward frees it
    last_read: dict[str, int] = field(default_factory=dict)
    # the results that depend on a parameter (the trace marks parameters only)
    differentiated: set[str] = field(default_factory=set)
    # under fusion: an elementwise op's result -> what it read; the same for the copies (fused_saves.is_copy)
    elementwise_inputs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    copy_inputs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # a result that an op after its piece's last parameter read makes or reads (the residual add after a block's
    # last matmul, the next norm's reduction): outside the region a checkpointed unit ending there recomputes
    # (passes.checkpoint_units), so kept by it as by an op of a later piece: the piece after the reader's
    trailing: dict[str, int] = field(default_factory=dict)

    def needs_grad(self, p) -> bool:
        return bool(p.requires_grad) or p.name in self.differentiated

    def root(self, name: str) -> str:
        """The result ``name`` views (``name`` itself where it is no view)."""
        return self.base.get(name, name)


def ops_by_piece(computation, piece_of_arg: dict[str, int], n: int, fused_attention=lambda bsym: False,
                 outputs: frozenset[str] = frozenset(), fuses: bool = False, region_of=None) -> Tally:
    """FLOPs, op counts, elementwise bytes moved, largest results (``outputs``, the names the forward returns,
    left out), kept bytes (all, and those matmuls make; ``fuses``: as a fusion executor keeps them,
    :mod:`~fsdp_pass.cost.fused_saves`) and the bytes read after the piece, of the forward's ops, each charged to
    the piece whose parameter the trace read last before it."""
    t = _empty_tally(n)
    if n == 0:  # a model without parameters: no piece to charge
        return t
    w = _Walk(piece_of_arg, fused_attention, outputs, fuses)
    ops = [b for b in computation.bound_symbols if not (is_return(b) or is_bookkeeping(b))]
    last_param_read = _last_param_reads(ops, piece_of_arg)
    tail_from = max(last_param_read.values(), default=len(ops)) + 1  # the loss inside the model, if any
    current = 0
    for k, bsym in enumerate(ops):
        read = [piece_of_arg[p.name] for p in bsym.flat_proxy_args if p.name in piece_of_arg]
        if read:
            current = max(read)
        _tally_op(t, w, bsym, current, k > last_param_read.get(current, k), k >= tail_from and not fuses)
    kept, selective = _kept_at_each_level(t, w, region_of)
    _charge_kept(t, w, kept, selective, n)
    _charge_read_later(t, w, kept, selective)
    return t


def _empty_tally(n: int) -> Tally:
    t = Tally(*([0] * n for _ in range(12)))
    t.flops, t.matmul_flops = [0.0] * n, [0.0] * n
    t.escaping, t.matmul_escaping = [{} for _ in range(n)], [{} for _ in range(n)]
    t.freed_in, t.passed_on = [{} for _ in range(n)], [{} for _ in range(n)]
    return t


def _last_param_reads(ops, piece_of_arg: dict[str, int]) -> dict[int, int]:
    """A piece -> the last op that reads one of its parameters."""
    last_param_read: dict[int, int] = {}
    for k, bsym in enumerate(ops):
        for p in bsym.flat_proxy_args:
            if p.name in piece_of_arg:
                last_param_read[piece_of_arg[p.name]] = k
    return last_param_read


def _tally_op(t: Tally, w: _Walk, bsym, current: int, after_last_read: bool, in_tail: bool) -> None:
    """Charges ``bsym`` to piece ``current``; ``after_last_read``: it runs after the piece's last parameter read;
    ``in_tail``: it runs after the forward's last parameter read (a loss the model computes; unfused only)."""
    if after_last_read:
        for p in (*bsym.flat_proxy_args, *bsym.flat_proxy_outs):
            if isinstance(p, TensorProxy):
                w.trailing[w.root(p.name)] = current + 1
    args = [p for p in bsym.flat_proxy_args if isinstance(p, TensorProxy)]
    for p in args:
        name = w.root(p.name)
        if name in w.made_in:
            w.last_read[name] = max(w.last_read.get(name, 0), current)
    matmul = _count_compute(t, w, bsym, current)
    outs = [o for o in bsym.flat_proxy_outs if isinstance(o, TensorProxy)]
    if any(w.needs_grad(p) for p in args):
        w.differentiated.update(o.name for o in outs if is_float_tensor(o))
    if is_view_like(bsym):
        for o in outs:
            w.base[o.name] = w.root(args[0].name) if args else o.name
        return
    for o in outs:
        w.made_in[o.name], w.proxy[o.name] = current, o
        if matmul:
            w.by_matmul.add(o.name)
    if is_attention(bsym) and not w.fused_attention(bsym):
        t.scores[current] = max(t.scores[current], attention_scores_bytes(bsym, masked=False))
    saved, fused_away = _note_saves(t, w, bsym, args, outs, current, after_last_read)
    t.acts[current] += 0 if fused_away else saved.inside_bytes
    if matmul:
        t.matmul_acts[current] += saved.inside_bytes
    if not matmul:
        t.moved[current] += tensor_bytes(bsym.flat_proxy_args) + tensor_bytes(bsym.flat_proxy_outs)
    kept_inside = [o for o in outs if is_float_tensor(o) and o.name not in w.outputs]
    largest = max([0, *(tensor_bytes((o,)) for o in kept_inside)])
    if in_tail:  # the loss the forward computes: its own point in the backward, before the last unit's
        t.tail_largest = max(t.tail_largest, largest)
    else:
        t.largest[current] = max(t.largest[current], largest)


def _count_compute(t: Tally, w: _Walk, bsym, current: int) -> bool:
    """Adds ``bsym``'s FLOPs and op count to piece ``current``'s (and to its matmuls' part); whether it is one."""
    flops = estimated_flops(bsym, skips_masked=not is_attention(bsym) or w.fused_attention(bsym))
    matmul = is_matmul_like(bsym)
    t.flops[current] += flops
    t.ops[current] += 1
    if matmul:
        t.matmul_flops[current] += flops
        t.matmul_ops[current] += 1
    return matmul


def _note_saves(t: Tally, w: _Walk, bsym, args, outs, current: int, after_last_read: bool) -> tuple[Saved, bool]:
    """Notes what ``bsym`` keeps for the backward, and whose backward frees it; returns what it keeps and whether a
    fusion executor fuses it away."""
    saved = _kept_by(bsym, w.fused_attention, w.needs_grad)
    fused_away = w.fuses and is_elementwise(bsym)
    # fused, its own intermediates are recomputed (item 4): a dtype conversion of an argument from the argument
    held = (*saved.inputs, *(saved.converted if fused_away else ()))
    keeps = [w.root(args[i].name) for i in held] + [outs[j].name for j in saved.outputs]
    # whose backward reads it: an op after its piece's last parameter read runs its backward before the piece's
    # (the schedule gathers a unit where its backward first reads a parameter), with the later piece's
    keeper = current + 1 if after_last_read else current  # the tail's: n
    for name in keeps:
        w.kept.add(name)
        w.kept_in.setdefault(name, set()).add(current)
        w.freed_by[name] = min(w.freed_by.get(name, keeper), keeper)
    for i in (*saved.inputs, *saved.converted):  # a parameter, or its conversion: read by the backward
        name = w.root(args[i].name)
        if name in w.piece_of_arg:
            t.reads_params[w.piece_of_arg[name]] = 1
    if fused_away or (w.fuses and is_copy(bsym)):
        for o in outs:
            read = tuple(w.root(p.name) for p in args)
            (w.elementwise_inputs if fused_away else w.copy_inputs)[o.name] = read
    return saved, fused_away


def _kept_at_each_level(t: Tally, w: _Walk, region_of) -> tuple[set[str], set[str]]:
    """What the backward keeps: without checkpointing, and at the selective level (the matmuls' results)."""
    kept, selective = w.kept, w.kept & w.by_matmul
    if w.fuses:
        nbytes = lambda name: tensor_bytes((w.proxy[name],))  # noqa: E731
        # the fused kernels recompute the elementwise ops at both levels; the selective level the copies too, so
        # it keeps what the chains through them start from, made by matmuls or not (fused_saves)
        selective = kept_after_fusion(kept, {**w.elementwise_inputs, **w.copy_inputs}, w.made_in, nbytes, region_of,
                                      w.kept_in)
        kept = kept_after_fusion(kept, w.elementwise_inputs, w.made_in, nbytes, region_of, w.kept_in)
        t.matmul_acts = list(t.acts)  # every op's intermediates that are kept (a fused elementwise op's: none)
    return kept, selective


def _charge_kept(t: Tally, w: _Walk, kept: set[str], selective: set[str], n: int) -> None:
    """Charges each kept result to the piece that made it, and notes the later backward that frees it."""
    for name in kept:
        if name in w.made_in:
            t.acts[w.made_in[name]] += tensor_bytes((w.proxy[name],))
            first = w.freed_by.get(name, w.made_in[name])
            if not w.fuses and first == n:
                t.tail_acts += tensor_bytes((w.proxy[name],))
            elif not w.fuses and first > w.made_in[name]:
                freed = t.freed_in[w.made_in[name]]
                freed[first] = freed.get(first, 0) + tensor_bytes((w.proxy[name],))
    for name in selective:
        if name in w.made_in:
            t.matmul_acts[w.made_in[name]] += tensor_bytes((w.proxy[name],))


def _charge_read_later(t: Tally, w: _Walk, kept: set[str], selective: set[str]) -> None:
    """The bytes each piece makes that a later piece reads: passed on (differentiated ones) and escaping."""
    for name, piece in w.made_in.items():
        read_by = w.last_read.get(name, piece)
        if read_by > piece and name in w.differentiated and is_float_tensor(w.proxy[name]):
            t.passed_on[piece][read_by] = t.passed_on[piece].get(read_by, 0) + tensor_bytes((w.proxy[name],))
        reader = max(w.last_read.get(name, piece), w.trailing.get(name, piece) if name in kept else piece)
        if reader > piece and is_float_tensor(w.proxy[name]):
            for escaping in (t.escaping, t.matmul_escaping) if name in selective else (t.escaping,):
                escaping[piece][reader] = escaping[piece].get(reader, 0) + tensor_bytes((w.proxy[name],))
