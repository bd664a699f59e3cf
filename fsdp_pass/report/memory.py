"""Predicted memory of one training step, read off the final forward and backward traces.

``step_memory(forward, backward) -> StepMemory``: the peak of tensor bytes a step allocates on top of
what lives before it (the sharded parameters, the optimizer state, the input batch).

The traces are executed in order, so every tensor's lifetime is visible. Each op's result is followed
as a *buffer*:

1. an op that computes writes a new buffer of its result's size;
2. a view or re-layout (reshape, slice, transpose, ...) shares its input's buffer; reshaping a
   non-contiguous tensor copies, so it writes a new one;
3. an all-gather writes its full gathered buffer when issued, and holds its send buffer until its wait
   (the executor keeps it alive while the collective runs); shards packed into their slice of the gathered
   buffer (``pack_shards`` when it copies) are that buffer, written whole by the pack op, which the
   all-gather fills in place; a reduce-scatter writes its shard and holds
   the full gradient buffer it reads likewise; over a group of one rank an all-gather or reduce-scatter
   returns its input, which then holds gathered parameters or gradient shards; a wait hands on the
   collective's result;
4. a buffer is freed after the last op that reads any name sharing it. What the forward returns (its
   output and what it saves for the backward) lives on into the backward, until the backward's last
   use of it; what the backward does not read (the forward's output: the logits, which the loss consumed) is
   not counted there, as the caller frees it (a caller that keeps it holds it on top of the peak); what the
   backward returns (the gradient shards) lives to the end of the step;
5. the gradients of the forward's outputs that the backward receives (its ``cotangents``: the logits'
   gradient when the loss is computed outside the model) are live from its start to their last use: Thunder's
   split autograd (``ThunderOutputFunction`` in ``thunder/executors/torch_autograd.py``) hands them over in a
   list that the trace empties, and torch's autograd engine keeps no reference;
6. a loss computed outside the model (the forward returns outputs with gradients and no 0-d one) runs its
   backward in eager before the backward trace starts, which no trace shows. It is taken to be a cross-entropy
   over the outputs' last dimension, as a language model's step computes it: the log-probabilities it saved
   and their gradient live beside each output's gradient while that is made, two buffers as large as each
   non-scalar cotangent, live at the backward's start only (op name :data:`CALLER_LOSS`; :func:`~fsdp_pass.plan.caller_loss.caller_loss`, by
   which ZeRO-3's last-unit rule prices the caller's loss too). A cheaper loss (a sum) makes this an over-count;
   one that upcasts the outputs first, an under-count.
7. an 8-bit gather's quantize op allocates the whole uint8 gathered buffer and writes this rank's slice of it
   (the all-gather fills it in place, as rule 3's packed shards), and both its ops hold a float32 scratch chunk
   while they run (:func:`fsdp_pass.ops.quantized_gather.scratch_bytes`): a buffer live at that op alone.

Buffers are tagged by what they hold, so the peak can be read by kind: ``gathered`` parameters
(all-gather results and copies cut from them, also when the forward kept them for the backward),
``saved`` (other forward results kept for the backward: activations, from their write in the forward on), ``gradients``
(unsharded parameter gradients: those a pack op reads, the flat buffer it packs them into, what
``no_sync``'s accumulators add), ``gradient shards`` (a reduce-scatter's result and the shard gradients
cut from it, which the step hands to the optimizer) and ``other`` (activations, their gradients,
temporaries, the packed shards an all-gather sends). Each buffer also names the op that wrote it and, for
the pass's own ops, the unit, so what is live at the peak can be listed (:meth:`TraceMemory.live_at`).

Not modelled: scratch memory inside one op (e.g. a matmul's workspace), allocator rounding and
fragmentation, and the process group's own memory (gloo copies each collective's full buffer into
scratch on its worker thread while the collective runs; NCCL works in place).
"""

from __future__ import annotations

from dataclasses import dataclass

from thunder.core.proxies import TensorProxy
from thunder.core.pytree import tree_flatten

from fsdp_pass.op_names import (
    ALL_GATHER_OP,
    ALL_REDUCE_OP,
    DEQUANTIZE_GATHERED_OP,
    REDUCE_SCATTER_OP,
    TORCH_ALL_GATHER_OP,
    TORCH_ALL_REDUCE_OP,
    TORCH_REDUCE_SCATTER_OP,
)
from fsdp_pass.ops.flat_buffers import allocated_bytes, collective_returns_input, gathers_in_place, views_of_inputs
from fsdp_pass.ops.quantized_gather import quantized_gather_bytes, scratch_bytes
from fsdp_pass.plan.caller_loss import caller_loss, has_own_loss
from fsdp_pass.predicates import (
    is_all_gather,
    is_all_reduce,
    is_bookkeeping,
    is_dequantize_gathered,
    is_getitem,
    is_grad_accumulation,
    is_pack_grads,
    is_pack_shards,
    is_quantize_shard,
    is_reduce_scatter,
    is_reshape,
    is_return,
    is_slice,
    is_unit_op,
    is_unpack_gathered,
    is_unpack_grad_shard,
    is_view_like,
    is_wait,
    unit_of_op,
)

# the names collectives have in the final traces (this pass's executor, and Thunder's torch executor)
_COLLECTIVE_OPS = frozenset(
    (ALL_GATHER_OP, REDUCE_SCATTER_OP, ALL_REDUCE_OP, TORCH_ALL_GATHER_OP, TORCH_REDUCE_SCATTER_OP, TORCH_ALL_REDUCE_OP)
)
GATHERED, SAVED, GRADIENTS, GRAD_SHARDS, OTHER = "gathered", "saved", "gradients", "gradient shards", "other"
KINDS = (GATHERED, SAVED, GRADIENTS, GRAD_SHARDS, OTHER)


COTANGENT = "cotangent"  # the op name of a buffer the backward receives as an output's gradient (rule 5)
CALLER_LOSS = "loss outside the model"  # the op name of what a loss computed by the caller holds (rule 6)


def tensor_bytes(proxy) -> int:
    return int(proxy.numel) * proxy.dtype.bytes


@dataclass(frozen=True)
class Buffer:
    name: str  # the proxy that first held it
    nbytes: int
    kind: str  # one of KINDS
    start: int  # index of the op that writes it (-1: carried in from the forward)
    end: int  # index of the last op that reads it (len(trace) when it outlives the trace)
    op: str = ""  # the name of the op that wrote it, as printed in the trace (e.g. "fsdp_pack_grads", "matmul")
    unit: str | None = None  # its unit: named by the pass's op that wrote it, the pack op that reads a gradient, or (a
    # collective's result) the op that packed what the collective sends


@dataclass(frozen=True)
class TraceMemory:
    """Every buffer a trace allocates (or carries in), and the peak of their sum."""

    buffers: tuple[Buffer, ...]
    peak_bytes: int
    peak_at: int  # index of the op at which the peak is reached
    peak_by_kind: dict  # kind -> bytes live at the peak
    handed_on: dict  # returned tensor name -> its Buffer (what the next trace receives)
    ops: tuple[tuple[str, str | None], ...] = ()  # per op of the trace: its name, and its unit for the pass's ops

    def op_at(self, i: int) -> str:
        """The op at index ``i``, as a reader finds it in the printed trace: ``fsdp_pack_grads of unit 'x'``."""
        if not 0 <= i < len(self.ops):
            return "the start" if i < 0 else "the end"
        name, unit = self.ops[i]
        return f"{name} of unit {unit!r}" if unit is not None else name

    def live_at(self, i: int) -> tuple[Buffer, ...]:
        """The buffers live at op ``i``, largest first."""
        return tuple(sorted((b for b in self.buffers if b.start <= i <= b.end), key=lambda b: -b.nbytes))

    def live_per_op(self, n_ops: int, keep=lambda buf: True) -> list[int]:
        """Bytes live at each of the trace's ``n_ops`` ops, counting the buffers ``keep`` accepts."""
        delta = [0] * (n_ops + 2)
        for b in self.buffers:
            if keep(b):
                delta[max(b.start, 0)] += b.nbytes
                delta[min(b.end, n_ops) + 1] -= b.nbytes
        live, out = 0, []
        for d in delta[:n_ops]:
            live += d
            out.append(live)
        return out


def _contiguous_after(bsym, src_contiguous: bool, src_shape) -> bool:
    """Is the view's result still contiguous?"""
    if is_reshape(bsym):
        return True  # a reshape of a contiguous tensor is; of a non-contiguous one, it copied
    if is_slice(bsym):
        if is_getitem(bsym):
            key = bsym.args[1] if isinstance(bsym.args[1], tuple) else (bsym.args[1],)
            rows_only = all(isinstance(k, slice) and k == slice(None) for k in key[1:])
        else:
            start, end = bsym.args[1], bsym.args[2]
            rows_only = all(s == 0 and e == n for s, e, n in list(zip(start, end, src_shape))[1:])
        return src_contiguous and rows_only
    return False  # transpose, permute, expand, broadcast: strided views


class _Buffers:
    """The buffers of one trace as it is walked op by op: which buffer each name holds, and each buffer's
    size, kind, first write and last read."""

    def __init__(self, carried_in: dict[str, Buffer]):
        self.buffer_of: dict[str, str] = {}  # tensor / future name -> buffer id
        self.held_by_future: dict[str, str] = {}  # future name -> the send buffer it keeps alive
        self.contiguous: dict[str, bool] = {}
        self.size, self.kind, self.start, self.last = {}, {}, {}, {}
        self.written_by: dict[str, tuple[str, str | None]] = {}  # buffer id -> (op name, unit)
        self.handed_on_names: set[str] = set()
        self.gathered_in_place: set[str] = set()  # packed shards: the slice of the gathered buffer they fill
        self.unit_of: dict[str, str] = {}  # output name of one of the pass's unit ops -> its unit (followed or not)
        for name, buf in carried_in.items():
            self.share(name, buf.name, True)
            if buf.name not in self.size:
                saved_kind = GATHERED if buf.kind == GATHERED else SAVED  # kept parameters stay parameters
                self.size[buf.name], self.kind[buf.name] = buf.nbytes, saved_kind
                self.start[buf.name] = self.last[buf.name] = -1
                self.written_by[buf.name] = (buf.op, buf.unit)

    def new(self, proxy, i: int, b, kind: str = OTHER, nbytes: int | None = None) -> None:
        """A new buffer for ``proxy``, written by op ``i`` (bound symbol ``b``; None: handed in by the caller)."""
        self.share(proxy.name, proxy.name, True)
        self.size[proxy.name], self.kind[proxy.name] = tensor_bytes(proxy) if nbytes is None else nbytes, kind
        self.start[proxy.name] = self.last[proxy.name] = i
        self.written_by[proxy.name] = (b.sym.name, unit_of_op(b)) if b is not None else (COTANGENT, None)

    def mark_gradients(self, b, read) -> None:
        """What a pack op or no_sync's accumulation reads is unsharded gradients of its unit (unless it is a
        parameter)."""
        for p in read:
            buf = self.buffer_of[p.name]
            if self.kind[buf] == OTHER:
                self.kind[buf] = GRADIENTS
                self.written_by[buf] = (self.written_by[buf][0], unit_of_op(b))

    def mark_saved(self, ret) -> None:
        """What a forward returns beside its outputs is saved for the backward: activations (and what else the
        forward computed) among it are saved activations from their write on; gathered parameters stay gathered."""
        for p in tree_flatten(ret.args[1:])[0]:
            if isinstance(p, TensorProxy) and p.name in self.buffer_of and self.kind[self.buffer_of[p.name]] == OTHER:
                self.kind[self.buffer_of[p.name]] = SAVED

    def share(self, name: str, buffer: str, contiguous: bool) -> None:
        self.buffer_of[name], self.contiguous[name] = buffer, contiguous

    def read(self, b, i: int) -> list:
        """The followed proxies ``b`` reads; their buffers (and what a future holds) live at least to ``i``."""
        read = [p for p in b.flat_proxy_args if p.name in self.buffer_of]
        for p in read:
            self.last[self.buffer_of[p.name]] = max(self.last[self.buffer_of[p.name]], i)
            if p.name in self.held_by_future:
                self.last[self.held_by_future[p.name]] = max(self.last[self.held_by_future[p.name]], i)
        return read

    def renamed(self, b, read) -> None:
        """Unpacking the saved list or a shallow copy: the same tensors under new names."""
        srcs = [p for p in read if isinstance(p, TensorProxy)]
        for o in b.flat_proxy_outs:
            if isinstance(o, TensorProxy) and o.name not in self.buffer_of and len(srcs) == 1:
                self.share(o.name, self.buffer_of[srcs[0].name], self.contiguous[srcs[0].name])

    def collective(self, b, i: int) -> None:
        """Writes its result buffer when issued; its future keeps the send buffer alive until the wait. An
        all-reduce that skips its clone (HSDP's, of a reduced shard) sums in place: its result is its input. Its
        result is of the unit whose op packed what it sends (a shard packed as a view of itself included)."""
        send = b.flat_proxy_args[0]
        unit = self.unit_of.get(send.name)
        if unit is not None:
            self.unit_of[b.output.name] = unit
        if is_all_reduce(b) and b.args[4] and send.name in self.buffer_of:
            self.share(b.output.name, self.buffer_of[send.name], self.contiguous[send.name])
            return
        in_place = is_all_gather(b) and send.name in self.gathered_in_place  # packed into its slice of this buffer
        if in_place or collective_returns_input(b):  # or over one rank: the result is the input
            if send.name not in self.buffer_of:  # a view of what is not followed (a parameter's shard)
                return
            buf = self.buffer_of[send.name]
            self.share(b.output.name, buf, True)
            kind = GATHERED if is_all_gather(b) else GRAD_SHARDS  # what the buffer holds from now on
            self.kind[buf], self.written_by[buf] = kind, (b.sym.name, self.written_by[buf][1])
            return
        self.new(b.output, i, b, GATHERED if is_all_gather(b) else GRAD_SHARDS)
        self.written_by[b.output.name] = (b.sym.name, unit)
        if send.name in self.buffer_of:
            self.held_by_future[b.output.name] = self.buffer_of[send.name]

    def view(self, b, src, i: int) -> None:
        """A view shares its input's buffer; reshaping a non-contiguous tensor copies it."""
        if is_reshape(b) and not self.contiguous[src.name]:
            self.new(b.output, i, b, self.kind[self.buffer_of[src.name]])  # a copy, of the same kind of data
            return
        for o in b.flat_proxy_outs:
            self.share(o.name, self.buffer_of[src.name], _contiguous_after(b, self.contiguous[src.name], src.shape))

    def unit_op(self, b, read, i: int) -> None:
        """The pass's pack and unpack ops: some outputs are views of an input, the rest new buffers (the
        parameters cut out of a gathered buffer are gathered parameters; a packed or accumulated gradient
        buffer is gradients, an unpacked gradient shard is a gradient shard)."""
        if is_pack_grads(b) or is_grad_accumulation(b):
            self.mark_gradients(b, read)
        views = views_of_inputs(b)
        self.unit_of.update((o.name, unit_of_op(b)) for o in b.flat_proxy_outs if isinstance(o, TensorProxy))
        kind = OTHER
        if is_unpack_gathered(b) or is_dequantize_gathered(b):  # dequantized: gathered parameters too
            kind = GATHERED
        elif is_pack_grads(b) or is_grad_accumulation(b):
            kind = GRADIENTS
        elif is_unpack_grad_shard(b):
            kind = GRAD_SHARDS
        for o in b.flat_proxy_outs:
            if not isinstance(o, TensorProxy):
                continue
            src = views.get(o.name)
            if src is not None and src.name in self.buffer_of:
                self.share(o.name, self.buffer_of[src.name], True)
            elif src is None:
                self.new(o, i, b, kind, quantized_gather_bytes(b) if is_quantize_shard(b) else allocated_bytes(b, o))
        if (is_pack_shards(b) and gathers_in_place(b)) or is_quantize_shard(b):
            self.gathered_in_place.add(b.output.name)
        if scratch_bytes(b):
            self.scratch(b, i, scratch_bytes(b))

    def scratch(self, b, i: int, nbytes: int) -> None:
        """What op ``i`` (bound symbol ``b``) holds while it runs, beside its outputs (rule 7)."""
        name = f"{b.flat_proxy_outs[0].name}:scratch"
        self.size[name], self.kind[name], self.start[name], self.last[name] = nbytes, OTHER, i, i
        self.written_by[name] = (b.sym.name, unit_of_op(b))

    def op(self, b, i: int) -> None:
        """Step ``i`` of the trace: bound symbol ``b``."""
        read = self.read(b, i)
        if is_return(b):
            self.handed_on_names.update(p.name for p in read)
            self.mark_saved(b)
        elif is_bookkeeping(b):
            self.renamed(b, read)
        elif is_all_gather(b) or is_reduce_scatter(b) or is_all_reduce(b):
            self.collective(b, i)
        elif is_wait(b):
            if b.args[0].name in self.buffer_of:  # else a one-rank gather of a shard: not followed
                self.share(b.output.name, self.buffer_of[b.args[0].name], True)
        elif is_view_like(b):
            if len(read) == 1:  # else a view of something not followed (a parameter shard, the input batch)
                self.view(b, read[0], i)
        elif is_unit_op(b):
            self.unit_op(b, read, i)
        else:
            for o in b.flat_proxy_outs:
                if isinstance(o, TensorProxy):
                    self.new(o, i, b)


def trace_memory(trace, carried_in: dict[str, Buffer] | None = None, received=(), before=()) -> TraceMemory:
    """Follow every buffer of ``trace``. ``carried_in``: name -> Buffer the trace receives live (what the forward
    saved). ``received``: tensor proxies the trace receives from its caller (new buffers, live from the start to
    their last use: rule 5). ``before``: (name, bytes) of buffers the caller holds only before the trace starts
    (rule 6), live at its start."""
    followed = _Buffers(carried_in or {})
    for p in received:
        followed.new(p, -1, None)
    for i, b in enumerate(trace.bound_symbols):
        followed.op(b, i)
    end = len(trace.bound_symbols)
    returned_buffers = {followed.buffer_of[n] for n in followed.handed_on_names}
    carried = {buf.name for buf in (carried_in or {}).values()}
    buffers = tuple(
        Buffer(
            k,
            followed.size[k],
            followed.kind[k],
            followed.start[k],
            end if k in returned_buffers else followed.last[k],
            *followed.written_by[k],
        )
        for k in followed.size
        if not (k in carried and followed.last[k] < 0 and k not in returned_buffers)  # rule 4: not read here
    ) + tuple(Buffer(name, nbytes, OTHER, -1, -1, CALLER_LOSS) for name, nbytes in before)
    peak, peak_at, peak_by_kind = _peak(buffers)
    by_id = {buf.name: buf for buf in buffers}
    handed_on = {n: by_id[followed.buffer_of[n]] for n in followed.handed_on_names}
    ops = tuple((b.sym.name, unit_of_op(b)) for b in trace.bound_symbols)
    return TraceMemory(buffers, peak, peak_at, peak_by_kind, handed_on, ops)


def _peak(buffers) -> tuple[int, int, dict]:
    events = sorted([(b.start, b.nbytes) for b in buffers] + [(b.end + 1, -b.nbytes) for b in buffers])
    live = peak = 0
    peak_at = 0
    for at, delta in events:
        live += delta
        if live > peak:
            peak, peak_at = live, at
    by_kind: dict[str, int] = {}
    for b in buffers:
        if b.start <= peak_at <= b.end:
            by_kind[b.kind] = by_kind.get(b.kind, 0) + b.nbytes
    return peak, peak_at, by_kind


@dataclass(frozen=True)
class StepMemory:
    """Bytes a forward + backward allocates above what lives before the step."""

    forward: TraceMemory
    backward: TraceMemory | None
    saved_bytes: int  # what the forward keeps for the backward (gathered parameters included)
    saved_gathered_bytes: int  # of which gathered parameters (ZeRO-2, and units not resharded)
    # the forward returns a 0-d output with a gradient: a loss computed inside the model (a Hugging Face model fed
    # labels returns it next to its logits, whose gradient the backward receives too)
    returns_a_loss: bool = False

    @property
    def peak_bytes(self) -> int:
        return max(self.forward.peak_bytes, self.backward.peak_bytes if self.backward else 0)

    @property
    def output_grad_bytes(self) -> int:
        """The gradients of the forward's outputs the backward receives (rule 5)."""
        return sum(b.nbytes for b in self.backward.buffers if b.op == COTANGENT) if self.backward else 0

    @property
    def caller_loss_bytes(self) -> int:
        """What a loss computed outside the model holds at the backward's start beside its outputs' gradients
        (rule 6)."""
        return sum(b.nbytes for b in self.backward.buffers if b.op == CALLER_LOSS) if self.backward else 0

    @property
    def peak_phase(self) -> str:
        return "backward" if self.backward and self.backward.peak_bytes > self.forward.peak_bytes else "forward"

    @property
    def peak_trace(self) -> TraceMemory:
        """The forward's or the backward's memory, whichever peaks higher."""
        return self.backward if self.peak_phase == "backward" else self.forward

    @property
    def peak_by_kind(self) -> dict:
        return self.peak_trace.peak_by_kind

    def live_at_peak(self) -> tuple[Buffer, ...]:
        """The buffers live at the step's peak, largest first (they add up to :attr:`peak_bytes`)."""
        return self.peak_trace.live_at(self.peak_trace.peak_at)

    def gathered_peak(self) -> GatheredPeak:
        """Where the gathered parameters live at once peak, and what they are then."""
        best = None
        for phase, m in (("forward", self.forward), ("backward", self.backward)):
            if m is None:
                continue
            live = m.live_per_op(len(m.ops), lambda b: b.kind == GATHERED)
            if live and (best is None or max(live) > best[2]):
                at = live.index(max(live))
                best = (phase, m, max(live), at)
        if best is None or best[2] == 0:
            return GatheredPeak("forward", 0, "", ())
        phase, m, _, at = best
        return GatheredPeak(phase, at, m.op_at(at), tuple(b for b in m.live_at(at) if b.kind == GATHERED))


@dataclass(frozen=True)
class GatheredPeak:
    """The moment of a step with the most gathered (unsharded) parameter bytes live, and those buffers: the flat
    buffers all-gathers wrote (padding rows included) and the parameters cut out of them."""

    phase: str  # "forward" or "backward"
    at: int  # op index in that phase's trace
    op: str  # the op there (TraceMemory.op_at)
    buffers: tuple[Buffer, ...]

    @property
    def bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    @property
    def flat_buffers(self) -> tuple[Buffer, ...]:
        """What all-gathers wrote: whole units as gathered (a one-parameter unit's parameter is a view of it)."""
        return tuple(b for b in self.buffers if is_collective_output(b))

    @property
    def dequantized(self) -> tuple[Buffer, ...]:
        """What an 8-bit gather's dequantize wrote: whole units in the compute dtype (rule 7)."""
        return tuple(b for b in self.buffers if b.op == DEQUANTIZE_GATHERED_OP)

    @property
    def cut_out(self) -> tuple[Buffer, ...]:
        """Parameters copied out of a gathered (or dequantized) buffer (and kept for the backward, in the backward)."""
        return tuple(b for b in self.buffers if not is_collective_output(b) and b.op != DEQUANTIZE_GATHERED_OP)


def is_collective_output(buf: Buffer) -> bool:
    """Whether a collective wrote ``buf`` (its result: a gathered buffer, a reduced shard)."""
    return buf.op in _COLLECTIVE_OPS


def live_over_step(forward, backward, gathered_only: bool = False) -> list[int]:
    """Bytes live at each op of the forward, then of the backward (for a plot of memory over a step).

    ``gathered_only``: only gathered parameters, including those the forward saved for the backward.
    """
    keep = (lambda b: b.kind == GATHERED) if gathered_only else (lambda b: True)
    return _live_over_step(step_memory(forward, backward), forward, backward, keep)


def live_by_kind_over_step(forward, backward) -> dict[str, list[int]]:
    """Kind (:data:`KINDS`) -> bytes of that kind live at each op of the forward, then of the backward: the
    layers of a stacked plot of the step's memory (they add up to :func:`live_over_step`)."""
    m = step_memory(forward, backward)
    return {kind: _live_over_step(m, forward, backward, lambda b, k=kind: b.kind == k) for kind in KINDS}


def _live_over_step(m: StepMemory, forward, backward, keep) -> list[int]:
    out = m.forward.live_per_op(len(forward.bound_symbols), keep)
    if backward is not None:
        out += m.backward.live_per_op(len(backward.bound_symbols), keep)
    return out


def cotangents(backward) -> list[TensorProxy]:
    """The gradients of the forward's outputs that ``backward`` receives (its ``cotangents`` argument)."""
    names = [name for name, _ in backward.siginfo().args]
    if "cotangents" not in names:
        return []
    flat, _ = tree_flatten(backward.args[names.index("cotangents")])
    return [p for p in flat if isinstance(p, TensorProxy)]


def step_memory(forward, backward=None) -> StepMemory:
    fwd = trace_memory(forward)
    saved = {buf.name: buf for buf in fwd.handed_on.values()}
    output_grads = cotangents(backward) if backward is not None else []
    loss_outside = caller_loss(output_grads)  # rule 6
    bwd = trace_memory(backward, fwd.handed_on, output_grads, loss_outside) if backward is not None else None
    return StepMemory(
        fwd,
        bwd,
        sum(b.nbytes for b in saved.values()),
        sum(b.nbytes for b in saved.values() if b.kind == GATHERED),
        has_own_loss(output_grads),
    )
