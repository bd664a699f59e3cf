"""What a step communicates and how much unsharded parameter memory it holds, read off the final traces.

``step_stats(forward, backward, world_size) -> StepStats`` works on any Thunder forward/backward pair
that uses Thunder's distributed prims (this pass's traces, and Thunder's own FSDP's):

1. every all-gather, reduce-scatter and all-reduce, with the size of its full (unsharded) buffer;
2. bytes each rank sends per step, in the ring model: an all-gather or reduce-scatter of a full buffer of
   S bytes costs (N-1)/N * S per rank, an all-reduce twice that;
3. peak gathered-parameter bytes: a gathered buffer is live from its all-gather's issue to the last use
   of anything cut out of it (views, reshapes, slices). What the forward saves for the backward stays
   live until the backward's last use of it.

The floor that ZeRO cannot beat (P parameters of b bytes, N ranks): ZeRO-2 sends 2(N-1)/N*P*b per rank and
step (one gather, one reduce-scatter of everything), ZeRO-3 3(N-1)/N*P*b (everything gathered twice).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_pass.predicates import (
    is_all_gather,
    is_all_reduce,
    is_getitem,
    is_reduce_scatter,
    is_reshape,
    is_return,
    is_slice,
    is_view_like,
    is_wait,
)


@dataclass(frozen=True)
class Collective:
    phase: str  # "forward" or "backward"
    kind: str  # "all_gather", "reduce_scatter", "all_reduce"
    position: int  # index in its trace
    full_bytes: int  # the unsharded buffer: gathered output, or reduce-scatter / all-reduce input


def _bytes(proxy) -> int:
    return proxy.numel * proxy.dtype.bytes


def collectives_of(trace, phase: str) -> list[Collective]:
    out = []
    for i, b in enumerate(trace.bound_symbols):
        if is_all_gather(b):
            out.append(Collective(phase, "all_gather", i, _bytes(b.output)))
        elif is_reduce_scatter(b):
            out.append(Collective(phase, "reduce_scatter", i, _bytes(b.flat_proxy_args[0])))
        elif is_all_reduce(b):
            out.append(Collective(phase, "all_reduce", i, _bytes(b.flat_proxy_args[0])))
    return out


def _rows_only(bsym, shape) -> bool:
    """Does this slice keep whole rows (slices dim 0 at most), so a contiguous input stays contiguous?"""
    args = bsym.args
    if is_getitem(bsym):
        key = args[1] if isinstance(args[1], tuple) else (args[1],)
        return all(isinstance(k, slice) and k == slice(None) for k in key[1:])
    start, end = args[1], args[2]  # slice prim: start and end indices per dim
    return all(s == 0 and e == n for s, e, n in list(zip(start, end, shape))[1:])


def _gathered_live_bytes(trace, carried_in: dict[str, tuple[str, int]]):
    """Peak bytes of gathered parameter memory live in ``trace``, and what its return hands on.

    Memory is followed per buffer: an all-gather's output, and every copy cut out of it (reshaping a
    column slice of a multi-parameter buffer copies; slicing rows or viewing does not). A buffer lives
    from its creation to the last use of any view of it. ``carried_in`` and the result's second item
    map a tensor name to (its buffer, the buffer's bytes).
    """
    bsyms = trace.bound_symbols
    buffer_of = {name: buf for name, (buf, _) in carried_in.items()}
    contiguous = dict.fromkeys(buffer_of, False)
    size = {buf: nbytes for buf, nbytes in carried_in.values()}
    start = dict.fromkeys(size, 0)
    last = dict.fromkeys(size, 0)
    handed_on: dict[str, tuple[str, int]] = {}

    def new_buffer(proxy, i):
        buffer_of[proxy.name], contiguous[proxy.name] = proxy.name, True
        size[proxy.name], start[proxy.name], last[proxy.name] = _bytes(proxy), i, i

    for i, b in enumerate(bsyms):
        if is_all_gather(b):
            new_buffer(b.output, i)
            continue
        tracked = [p for p in b.flat_proxy_args if p.name in buffer_of]
        if not tracked:
            continue
        if is_return(b):
            handed_on.update({p.name: (buffer_of[p.name], size[buffer_of[p.name]]) for p in tracked})
        for p in tracked:
            last[buffer_of[p.name]] = len(bsyms) if is_return(b) else i
        if len(tracked) != 1 or not (is_wait(b) or is_view_like(b)):
            continue
        (src,) = tracked
        out = b.flat_proxy_outs
        if is_reshape(b) and not contiguous[src.name]:
            new_buffer(out[0], i)  # a copy: the parameter leaves the gathered buffer
            continue
        keeps = is_wait(b) or is_reshape(b) or (is_slice(b) and _rows_only(b, src.shape))
        for o in out:
            buffer_of[o.name], contiguous[o.name] = buffer_of[src.name], contiguous[src.name] and keeps
    events = sorted([(start[k], size[k]) for k in size] + [(last[k] + 1, -size[k]) for k in size])
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak, handed_on


@dataclass(frozen=True)
class StepStats:
    world_size: int
    collectives: tuple[Collective, ...]
    peak_gathered_bytes: int

    def count(self, kind: str | None = None, phase: str | None = None) -> int:
        return sum(1 for c in self.collectives if kind in (None, c.kind) and phase in (None, c.phase))

    @property
    def bytes_per_rank(self) -> float:
        n = self.world_size
        return sum(c.full_bytes * (n - 1) / n * (2 if c.kind == "all_reduce" else 1) for c in self.collectives)

    def breakdown(self) -> str:
        """e.g. ``'6 AG (4 fwd + 2 bwd) + 4 RS'``."""
        ag_f, ag_b = self.count("all_gather", "forward"), self.count("all_gather", "backward")
        parts = [f"{ag_f + ag_b} AG ({ag_f} fwd + {ag_b} bwd)"] if ag_f + ag_b else []
        if self.count("reduce_scatter"):
            parts.append(f"{self.count('reduce_scatter')} RS")
        if self.count("all_reduce"):
            parts.append(f"{self.count('all_reduce')} AR")
        return " + ".join(parts) or "none"


def step_stats(forward, backward, world_size: int) -> StepStats:
    fwd_peak, saved = _gathered_live_bytes(forward, {})
    # the backward receives the saved tensors under the forward's names
    bwd_peak, _ = _gathered_live_bytes(backward, saved) if backward is not None else (0, {})
    colls = collectives_of(forward, "forward") + (collectives_of(backward, "backward") if backward is not None else [])
    return StepStats(world_size, tuple(colls), max(fwd_peak, bwd_peak))


def floor_bytes(param_bytes: int, world_size: int, gathers_per_step: int) -> float:
    """Per-rank bytes per step no ZeRO scheme can go below: ``gathers_per_step`` gathers + 1 reduce-scatter."""
    return (gathers_per_step + 1) * (world_size - 1) / world_size * param_bytes
