"""Gloo process groups over ranks spawned on this machine: the timeline, the test pool and the benchmark."""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist


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
