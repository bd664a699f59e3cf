"""Process groups made on one machine: a fake group of any world size in one process, and gloo groups
over ranks spawned here.

``fake_process_group(world_size)`` uses torch's ``fake`` backend: collectives return immediately without
moving data, so traces can be built, printed and counted at world size 64 on a laptop. Nothing computed
under it is a real result.

``free_port()`` and ``init_local_gloo(rank, world_size, port, timeout_s)`` join ranks spawned on this
machine into one gloo group (the timeline, the test pool, the benchmark and the notebooks use them);
``run_on_local_ranks(fn, world_size, ...)`` spawns the ranks, runs ``fn`` on each in that group and returns
every rank's result.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import sys
import tempfile
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.distributed_c10d import _get_process_group_store  # torch has no public name for it

from fsdp_pass.errors import check


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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_local_gloo(rank: int, world_size: int, port: int, timeout_s: float) -> None:
    """Join the default gloo process group of ``world_size`` local ranks meeting at ``port``; a collective
    that waits longer than ``timeout_s`` for a peer fails instead of hanging."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _local_rank(rank, fn, world_size, port, timeout_s, args, kwargs, result_dir):
    torch.set_num_threads(1)  # the ranks share this machine's cores
    init_local_gloo(rank, world_size, port, timeout_s)
    try:
        result = fn(*args, **kwargs)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(result_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_on_local_ranks(fn, world_size: int, *args, timeout_s: float = 120, **kwargs) -> list:
    """Spawn ``world_size`` processes on this machine, join them in a gloo group (the default group, one CPU
    thread each), run ``fn(*args, **kwargs)`` on every one and return the results, rank 0's first. ``fn``
    must be importable by name (spawned processes import it), its result picklable. A rank that raises
    raises here, with its traceback; a collective waiting longer than ``timeout_s`` for a peer fails."""
    with tempfile.TemporaryDirectory() as result_dir:
        mp.start_processes(
            _local_rank,
            args=(fn, world_size, free_port(), timeout_s, args, kwargs, result_dir),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        results = []
        for rank in range(world_size):
            with open(os.path.join(result_dir, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def has_peers(group) -> bool:
    """A real group of more than one rank: what the cross-rank checks need (the fake backend moves nothing; one
    rank has nobody to disagree with or wait for)."""
    return group is not None and dist.get_backend(group) != "fake" and dist.get_world_size(group) > 1


def reduce_device(group=None, gpu=None) -> torch.device:
    """Where a small tensor is all-reduced over ``group`` (the default group if None): on the host under gloo or
    without a GPU, else on the GPU (NCCL reduces no host tensors, nor does the backend ``init_process_group()``
    picks on a GPU): ``gpu``, or this rank's current one."""
    group = group if group is not None else dist.group.WORLD
    if dist.get_backend(group) == "gloo" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device(gpu) if gpu is not None else torch.device("cuda", torch.cuda.current_device())


def reduced_across_ranks(values, op, group=None) -> list[float]:
    """``values`` reduced elementwise over the ranks of ``group`` (the default group if None) by ``op``, as
    float64, on :func:`reduce_device`."""
    group = group if group is not None else dist.group.WORLD
    reduced = torch.tensor(values, dtype=torch.float64, device=reduce_device(group))
    dist.all_reduce(reduced, op=op, group=group)
    return reduced.tolist()


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
