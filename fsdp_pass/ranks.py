"""Ranks and their groups, as every stage sees them: whether a group has peers to agree with
(``has_peers``), a small reduction over its ranks (``reduce_device``, ``reduced_across_ranks``), and ranks
spawned on this machine in one gloo group (``free_port``, ``init_local_gloo``, ``run_on_local_ranks``: the
timeline, the test pool, the benchmark, the probe and the notebooks use them).

The process groups the pass itself makes (a fake group, a host-side channel) are
:mod:`fsdp_pass.shard.groups`.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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
