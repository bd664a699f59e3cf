"""Process groups the pass makes: a fake group of any world size in one process, the store a group's ranks met
through, and a host-side gloo channel beside a group.

``fake_process_group(world_size)`` uses torch's ``fake`` backend: collectives return immediately without
moving data, so traces can be built, printed and counted at world size 64 on a laptop. Nothing computed
under it is a real result.

Ranks spawned on this machine in one gloo group (``free_port``, ``init_local_gloo``, ``run_on_local_ranks``) and
the small reductions over a group live in :mod:`fsdp_pass.ranks`, which every stage may import; they are named
here too for the notebooks and scripts that import them from here.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_process_group_store  # torch has no public name for it

from fsdp_pass.errors import check
from fsdp_pass.ranks import (  # noqa: F401  (named here for the notebooks and scripts that import them from here)
    free_port,
    has_peers,
    init_local_gloo,
    reduce_device,
    reduced_across_ranks,
    run_on_local_ranks,
)


@contextmanager
def fake_process_group(world_size: int, rank: int = 0):
    """Initialize the default process group with the fake backend for the duration of the block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # 2 s to import: only when used

    check(
        not dist.is_initialized(),
        "A default process group is already initialized.",
        "Use fake_process_group only in a process that has no real process group "
        "(call torch.distributed.destroy_process_group() first).",
    )
    hook = sys.excepthook  # init_process_group wraps it to prefix "[rank0]: ": once per dry run, unless restored
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def group_store(group):
    """The key-value store ``group``'s ranks met through (the TCPStore ``init_process_group`` made, prefixed
    for the group): what :mod:`fsdp_pass.verify.ranks_arrive` counts arrivals on, with no collective."""
    return _get_process_group_store(group)


_cpu_channels: dict = {}


def cpu_channel(group):
    """A gloo group over ``group``'s ranks, for the small host-side exchanges of the checks (no GPU sync, no
    stream): ``group`` itself when it is gloo, else one made the first time it is asked for (every rank of
    ``group`` asks at the same point: the first step) and kept."""
    if dist.get_backend(group) == "gloo":
        return group
    if group not in _cpu_channels:
        ranks = dist.get_process_group_ranks(group)
        _cpu_channels[group] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return _cpu_channels[group]
