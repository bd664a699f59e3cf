"""Before a collective helper moves any tensor, every rank must arrive at it: within a bounded time, or each
rank that did raises an FSDPError naming the helper and the ranks that did not.

``ranks_arrive(what, group, timeout)``, called first by every helper that runs collectives outside the
training step (``full_state_dict``, ``get_state_dict`` / ``set_state_dict``, ``save_checkpoint`` /
``load_checkpoint``, ...). Without it, a helper called on only some ranks (``if rank == 0:
full_state_dict(jm)``) waits in its first collective for the backend's timeout (30 minutes on gloo), then
dies in a backend error that names nothing of the user's.

The count goes through the key-value store the group's ranks met through, not through a collective, so a
rank that gives up leaves the process group as it was. Calls are counted per model (``scope``): a helper
that failed on one model does not shift the count of another.

1. each rank notes where it is, ``at/<rank> = "<what> #<n>"`` (``n``: how many helpers it has entered on
   this model), and adds one to the arrivals of ``<n>/<what>``;
2. the rank whose add completes the count marks the call complete; every other rank waits for that mark,
   at most ``timeout``;
3. a rank that waited in vain adds a large number to the count, so that a rank arriving after it gave up
   learns it from its own add (and raises too, instead of going on alone into a collective), then reads
   where the missing ranks are and raises.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from fsdp_pass.errors import fail
from fsdp_pass.ranks import has_peers
from fsdp_pass.shard.groups import group_store

_PREFIX = "fsdp_pass/arrive"
_GAVE_UP = 1 << 40  # what a rank that stopped waiting adds to a count: past any group size
_entered: dict = {}  # (process group, scope) -> how many helpers this rank has entered there


def _where(store, prefix: str, rank: int) -> str | None:
    key = f"{prefix}/at/{rank}"
    return store.get(key).decode() if store.check([key]) else None


def _missing_ranks(store, prefix: str, size: int, here: str) -> list[tuple[int, str | None]]:
    """(rank, where it is instead) for each rank of the group that has not arrived at ``here``."""
    return [(r, at) for r in range(size) if (at := _where(store, prefix, r)) != here]


def _describe(rank: int, at: str | None) -> str:
    return f"rank {rank} is in {at}" if at is not None else f"rank {rank} has entered no collective helper yet"


TODO = (
    "Call {what} on every rank, at the same point of the program (not under `if rank == 0:`); to keep a result on "
    "one rank only, pass the option that does so (e.g. StateDictOptions(full_state_dict=True, cpu_offload=True) "
    "keeps it on rank 0). If a rank is only slow to get there, raise FSDP(timeout=...)."
)


def ranks_arrive(what: str, group, timeout: datetime.timedelta, scope: str = "") -> None:
    """Collective over ``group`` (store round trips only): returns once every rank has called it for ``what``
    (a helper's name, e.g. ``"full_state_dict()"``) in ``scope`` (the model's), else raises an FSDPError after
    ``timeout`` (``FSDPOptions.timeout``, resolved from what ``FSDP(timeout=...)`` was given)."""
    if not has_peers(group):
        return
    store, size, rank = group_store(group), dist.get_world_size(group), dist.get_rank(group)
    prefix = f"{_PREFIX}/{scope}"
    n = _entered[group, scope] = _entered.get((group, scope), 0) + 1
    here = f"{what} #{n}"
    store.set(f"{prefix}/at/{rank}", here)
    count_key, wait = f"{prefix}/{n}/{what}", timeout
    arrived = store.add(count_key, 1)
    if arrived == size:
        store.set(f"{count_key}/all", "1")
        return
    if arrived > _GAVE_UP:
        fail(
            f"{what} is collective, and rank {rank} came to it after another rank had stopped waiting for it "
            f"(FSDP(timeout={wait.total_seconds():g} s)): that rank raised an FSDPError naming this one.",
            TODO.format(what=what),
        )
    try:
        store.wait([f"{count_key}/all"], wait)
        return
    except (RuntimeError, dist.DistError):  # the store's timeout
        if store.add(count_key, _GAVE_UP) - _GAVE_UP == size:  # the last rank came just now
            return
    missing = _missing_ranks(store, prefix, size, here)
    fail(
        f"{what} is collective: every rank of the group must call it, but after {wait.total_seconds():g} s rank "
        f"{rank} is there and "
        + ("; ".join(_describe(r, at) for r, at in missing) or "another rank is not")
        + f" (collective helper call #{n} on this model).",
        TODO.format(what=what),
    )
