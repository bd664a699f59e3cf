"""Run as a script (``python tests/exit_trials.py TRIALS [--without-hook]``): TRIALS times, two gloo ranks finish an
all-reduce and run off the end of the script, Python shutting down; prints every rank's exit code (0, or minus the
signal that ended it) as one JSON list of ``[rank 0, rank 1]`` pairs.

A rank aborted at exit (SIGABRT, "terminate called without an active exception") when its gloo worker thread was
still releasing the last collective's tensors as Python began to shut down (:mod:`fsdp_pass.shard.gloo_exit` says
why). Each rank here makes that race one it loses:

- it pins itself to one core and puts its other threads at the lowest priority: the main thread, which the
  finished collective wakes, takes the core and the GIL while the worker waits for the core;
- its switch interval is 1000 s: a thread that waits for the GIL never asks the main thread to hand it over, so
  the worker gets it only when the main thread lets go of it by itself (a sleep, some I/O);
- after the collective, the main thread computes for ~0.1 s in one C call, holding the GIL: time in which the
  worker gets the core now and then, reaches the release and waits for the GIL.

Without the exit hook (``--without-hook``) a rank died of SIGABRT in 10 of 16 trials when measured (a loaded 2-core
machine); with it, in none: the hook's wait lets the worker finish first.

Each trial costs little: torch is imported once and each trial forks its two ranks. A rank's shutdown is the
script's own up to the moment Python marks itself finalizing, where the race is decided; its garbage collection
then finds :class:`_CutShort`, which sleeps 0.2 s (letting go of the GIL, which a worker still waiting for it takes,
and aborts the process on) and ends the process with ``os._exit(0)``, instead of the seconds Python spends taking
torch's modules apart. The exit hook's module is loaded by its path (``import fsdp_pass`` installs the same hook,
but brings Thunder and the rest: seconds per process).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

BUSY = 3_000_000  # ~0.1 s of the main thread's own work after its last collective
GLOO_EXIT = Path(__file__).resolve().parent.parent / "fsdp_pass" / "shard" / "gloo_exit.py"


class _CutShort:
    """Put in a reference cycle: collected at Python's shutdown, it ends the process (collected earlier by an
    automatic collection, it puts a new one in its place)."""

    def __init__(self):
        self.cycle = self

    def __del__(self):
        if not sys.is_finalizing():
            _CutShort()
            return
        time.sleep(0.2)
        os._exit(0)


def _install_the_exit_hook() -> None:
    spec = importlib.util.spec_from_file_location("gloo_exit", GLOO_EXIT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install()


def _starve_other_threads(rank: int) -> None:
    """Pin this process to one core and put every thread but the main one at the lowest priority."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != os.getpid():
            os.setpriority(os.PRIO_PROCESS, int(tid), 19)


def _finish_a_collective(port: int, rank: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    _starve_other_threads(rank)
    sys.setswitchinterval(1000)
    _CutShort()
    dist.all_reduce(torch.ones(8))
    sum(range(BUSY))  # the main thread computes on a while, holding the GIL (one C call)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trials(n: int) -> list[list[int]] | None:
    """Each trial's two exit codes, in the parent; None in a rank, which then runs off the end of the script."""
    codes = []
    for _ in range(n):
        port, pids = _free_port(), []
        for rank in range(2):
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _finish_a_collective(port, rank)
                return None
            pids.append(pid)
        codes.append([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids])
    return codes


if __name__ == "__main__":
    torch.set_num_threads(1)
    if "--without-hook" not in sys.argv:
        _install_the_exit_hook()  # the ranks inherit it
    done = trials(int(sys.argv[1]))
    if done is not None:
        print(json.dumps(done))
