"""A process group of any world size in one process, for building and reading traces.

Uses torch's ``fake`` backend: collectives return immediately without moving data, so traces can
be built, printed and counted at world size 64 on a laptop. Nothing computed under it is a real
result.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch.distributed as dist

from fsdp_pass.errors import check


@contextmanager
def fake_process_group(world_size: int, rank: int = 0):
    """Initialize the default process group with the fake backend for the duration of the block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    check(
        not dist.is_initialized(),
        "A default process group is already initialized.",
        "Use fake_process_group only in a process that has no real process group "
        "(call torch.distributed.destroy_process_group() first).",
    )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
