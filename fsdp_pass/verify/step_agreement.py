"""The per-step agreement that every rank's step issues the same collectives, run beside the step's first
collective instead of before it.

What is compared is the 62-bit digest of a compiled variant's collective sequence
(:mod:`fsdp_pass.verify.same_collectives_on_all_ranks` keeps the sequences and puts the three ops below in the
final forward trace). The state is per model (``scope``) and is the same on every rank between steps: ``first``,
the first forward collective (kind, elements, dtype, device, group) of the variant every rank ran at the last step
that agreed (None before the first step).

1. ``check_same_collectives(key)``, right before the forward's first collective. If this variant's first
   collective is ``first`` (the steady state: whatever its input's shape, a rank starts its step with the same
   gather), it returns at once. Otherwise (the model's first step, or this rank's variant starts with another
   collective) it issues a collective of ``first``'s shape first, on ``first``'s group, with zeros (a stand-in for
   the one every other rank issues as its first collective, so the ranks' first collectives still match), then
   exchanges digests and waits: on a difference every rank raises (step 3), else ``first`` becomes this variant's.
2. ``exchange_step_digest(key)``, right after the first collective is issued: one all-reduce of ``(digest,
   -digest)`` (max), issued asynchronously on the host-side gloo channel
   (:func:`fsdp_pass.shard.groups.cpu_channel`), so it travels while the first gather does.
3. ``await_step_digests(key)``, right before the step's second collective (at the forward's end when it has one
   only): waits for step 2's exchange. Digests all equal: the step goes on. Else the ranks exchange their
   sequences and every rank raises the same FSDPError naming the first collective that differs.

Why no rank can issue a mismatched collective. By induction over steps, ``first`` is the same on every rank when a
step starts (it changes only where an exchange found every digest equal, to the one variant they share). Each
rank's first collective of the step is then ``first``'s shape: issued as the variant's own when it starts with it,
else as step 1's stand-in; the digest exchange comes next on every rank, and no rank issues a second collective
before it has seen every digest (step 3, or step 1's blocking exchange). A rank whose variant starts otherwise
has a digest that differs (the sequence is part of it), so either every rank raises after the one matching
collective, or every rank's variant starts otherwise alike (all changed together, as all entering ``no_grad``
would) and the stand-in is the step's one extra collective. On the model's first step, ``first`` is None on every
rank: the exchange comes before any collective, as it always did.

Why the exchange cannot be skipped on steps where this rank's variant did not change. A rank sees only its own
input. If rank 1 alone starts a variant with other collectives at step s, rank 0's view of step s is the same as
if it had not, and without a message from rank 1 it would go on into collectives rank 1 does not issue, and wait
there for the backend's timeout. So every step carries one exchange; what this module changes is that the step
no longer waits for it before its first collective: it travels beside the first gather, which the step waits for
anyway. Its cost: one 16-byte all-reduce of host latency when it is longer than the first gather (gloo's ring
takes 2(N-1) hops: at N ranks about 2(N-1) times one message's latency).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_pass.errors import fail
from fsdp_pass.op_names import CollectiveKind
from fsdp_pass.shard.groups import cpu_channel
from fsdp_pass.verify.rank_differences import DIFFERENT_TODO, describe_difference


@dataclass(frozen=True)
class FirstCollective:
    """The shape of a step's first collective: what a stand-in for it must issue."""

    kind: CollectiveKind
    numel: int  # of its input (a gather's shard buffer, a reduce-scatter's full buffer)
    dtype: torch.dtype
    device: str
    group: object


@dataclass
class Agreement:
    """One model's state: ``first`` (the same on every rank between steps), this step's pending exchange."""

    first: FirstCollective | None = None
    settled: bool = False  # this step's digests were already compared (step 1's blocking exchange)
    pending: object = None  # (work, tensor) of step 2's exchange
    blocked_s: float = 0.0  # host seconds spent waiting in this module, for the benchmark (bench.step_check)


_AGREEMENTS: dict[str, Agreement] = {}


def agreement(scope: str) -> Agreement:
    return _AGREEMENTS.setdefault(scope, Agreement())


def _digest_pair(d: int) -> torch.Tensor:
    return torch.tensor([d, -d], dtype=torch.int64)


def _agreed(both: torch.Tensor) -> bool:
    """Whether the max-reduced ``(digest, -digest)`` says every rank had the same digest (max == min)."""
    return int(both[0]) == -int(both[1])


OTHER_RANK_GONE = (
    "Another rank did not come to this step's collective check ({error}). A rank stopped (its process ended or "
    "raised: see its own error), or is running something else (a collective helper such as full_state_dict() "
    "that this rank did not call)."
)
OTHER_RANK_TODO = "Look at the other ranks' errors first; every rank must run the same steps and helpers in the same order."


def _stand_in(first: FirstCollective) -> None:
    """A collective of ``first``'s shape, with zeros, waited for: what every other rank issues first this step."""
    x = torch.zeros(first.numel, dtype=first.dtype, device=first.device)
    n = dist.get_world_size(first.group)
    if first.kind is CollectiveKind.ALL_GATHER:
        dist.all_gather_into_tensor(torch.empty(first.numel * n, dtype=x.dtype, device=x.device), x, first.group)
    elif first.kind is CollectiveKind.REDUCE_SCATTER:
        dist.reduce_scatter_tensor(torch.empty(first.numel // n, dtype=x.dtype, device=x.device), x, group=first.group)
    else:
        dist.all_reduce(x, group=first.group)


def settle_before_first(scope: str, channel, digest: int, mine: FirstCollective | None, describe) -> None:
    """Step 1. ``describe()`` -> this variant's sequences, for the error."""
    a = agreement(scope)
    a.pending, a.settled = None, False
    if a.first is not None and mine == a.first:
        return
    t0 = time.perf_counter()
    if a.first is not None:
        _stand_in(a.first)
    both = _digest_pair(digest)
    try:
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=channel)
    except (RuntimeError, dist.DistError) as e:
        fail(OTHER_RANK_GONE.format(error=f"{type(e).__name__}: {e}"), OTHER_RANK_TODO)
    a.blocked_s += time.perf_counter() - t0
    if not _agreed(both):
        raise_difference(channel, describe())
    a.first, a.settled = mine, True


def exchange(scope: str, channel, digest: int) -> None:
    """Step 2."""
    a = agreement(scope)
    if a.settled:
        return
    both = _digest_pair(digest)
    a.pending = (dist.all_reduce(both, op=dist.ReduceOp.MAX, group=channel, async_op=True), both)


def await_digests(scope: str, channel, describe) -> None:
    """Step 3."""
    a = agreement(scope)
    if a.settled or a.pending is None:
        return
    (work, both), a.pending = a.pending, None
    t0 = time.perf_counter()
    try:
        work.wait()
    except (RuntimeError, dist.DistError) as e:
        fail(OTHER_RANK_GONE.format(error=f"{type(e).__name__}: {e}"), OTHER_RANK_TODO)
    a.blocked_s += time.perf_counter() - t0
    if not _agreed(both):
        raise_difference(channel, describe())


def raise_difference(channel, mine: dict) -> None:
    """Every rank has seen that the digests differ: gather the sequences and plans, raise the same FSDPError
    everywhere."""
    prints: list = [None] * dist.get_world_size(channel)
    try:
        dist.all_gather_object(prints, mine, group=channel)
    except (RuntimeError, dist.DistError) as e:
        fail(OTHER_RANK_GONE.format(error=f"{type(e).__name__}: {e}"), OTHER_RANK_TODO)
    fail(*(describe_difference(prints) or ("the ranks' collective digests differ", DIFFERENT_TODO)))


def channel_of(group):
    return cpu_channel(group)
