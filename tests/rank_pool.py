"""A persistent pool of gloo ranks for tests: Thunder is imported once per rank, not once per test.

``RankPool(world_size).run(fn, *args)`` runs the module-level function ``fn`` on every rank (each
rank has the default process group initialized with gloo) and returns the per-rank results.

- A rank that raises: its traceback is re-raised in the test (``RankError``).
- A rank that hangs (e.g. a mismatched collective): after ``timeout`` seconds the pool is killed
  and ``TimeoutError`` says which ranks did not answer. The next ``run`` starts a fresh pool.
"""

from __future__ import annotations

import importlib
import os
import queue
import time
import traceback

import torch.multiprocessing as mp

from fsdp_pass.ranks import free_port


class RankError(AssertionError):
    pass


def _worker(rank, world_size, port, jobs, results, collective_timeout_s):
    import torch
    import torch.distributed as dist

    from fsdp_pass.ranks import init_local_gloo
    from tests.tracing_memos import install

    install()  # a third less time in Thunder's interpreter (tests/tracing_memos.py)
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    init_local_gloo(rank, world_size, port, collective_timeout_s)
    while True:
        job = jobs.get()
        if job is None:
            break
        module, name, args, kwargs = job
        try:
            fn = getattr(importlib.import_module(module), name)
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()
    results.close()
    results.join_thread()  # every result this rank put is in the pipe
    os._exit(0)  # no interpreter teardown: with Thunder loaded it takes seconds, and there is nothing left to do


COLLECTIVE_TIMEOUT_S = 120  # how long gloo lets a rank wait in a collective before it raises


class RankPool:
    def __init__(self, world_size: int, collective_timeout_s: int = COLLECTIVE_TIMEOUT_S):
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self.jobs = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, port, self.jobs[r], self.results, collective_timeout_s),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.alive = True

    def run(self, fn, *args, timeout: float = 600, **kwargs):
        assert self.alive, "pool was shut down"
        for q in self.jobs:
            q.put((fn.__module__, fn.__name__, args, kwargs))
        got: dict[int, tuple[bool, object]] = {}
        deadline = time.monotonic() + timeout
        first_error_at = None
        while len(got) < self.world_size:
            wait = deadline - time.monotonic()
            if first_error_at is not None:  # others may be stuck in a collective with the failed rank
                wait = min(wait, first_error_at + 20 - time.monotonic())
            try:
                rank, ok, payload = self.results.get(timeout=max(wait, 0.01))
            except queue.Empty:
                break
            got[rank] = (ok, payload)
            if not ok and first_error_at is None:
                first_error_at = time.monotonic()
        missing = [r for r in range(self.world_size) if r not in got]
        errors = {r: tb for r, (ok, tb) in got.items() if not ok}
        if missing:
            self.shutdown(kill=True)
        if errors:
            text = "\n".join(f"----- rank {r} -----\n{tb}" for r, tb in sorted(errors.items()))
            hung = f"\n(ranks {missing} did not finish: killed)" if missing else ""
            raise RankError(f"{fn.__name__} failed on ranks {sorted(errors)}:\n{text}{hung}")
        if missing:
            raise TimeoutError(f"{fn.__name__}: ranks {missing} did not finish within {timeout:.0f}s (hung collective?)")
        return [got[r][1] for r in range(self.world_size)]

    def shutdown(self, kill: bool = False):
        shutdown_all([self], kill)


def shutdown_all(pools, kill: bool = False):
    """Stop the ranks of every pool, then wait for them: the pools stop side by side."""
    live = [pool for pool in pools if pool.alive]
    for pool in live:
        pool.alive = False
        for p, q in zip(pool.procs, pool.jobs):
            if kill:
                p.kill()
            else:
                q.put(None)
    for p in (p for pool in live for p in pool.procs):
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
