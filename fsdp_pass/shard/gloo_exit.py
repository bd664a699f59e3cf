"""Before Python shuts down, wait until gloo's worker threads are idle, so that no rank aborts as it exits.

What aborted a finished run (``terminate called without an active exception``, SIGABRT, the launcher reports the
run FAILED), seen in a core dump of the rank that died:

1. A gloo process group runs each collective on one of its worker threads (``ProcessGroupGloo::runLoop``, thread
   name ``pt_gloo_runloop``). The worker marks the collective done, which returns the caller's ``wait()``, and only
   then drops its own reference to the finished work: the work's tensors are released on the worker thread.
2. In torch 2.11 releasing a tensor that has a Python object (every tensor Python made or saw) takes the GIL: the
   tensor keeps its Python object alive while C++ holds it, and lets go of it, with the GIL, when C++ lets go
   (``TensorImpl::decref_pyobject``; the decref checks ``Py_IsInitialized()`` and then waits for the GIL).
3. If the main thread has meanwhile run off the end of the script, it holds the GIL into ``Py_FinalizeEx``; once
   that marks the interpreter as finalizing, CPython 3.11 ends any other thread that waits for the GIL with
   ``pthread_exit``. Its forced unwind meets torch's ``noexcept`` decref, and C++ calls ``std::terminate``.

So a rank aborts when its last collective's worker is still on its way to that release as Python starts shutting
down: now and then, more often on a busy machine (a two-rank torch script that ends on an all-reduce: 2 aborts in
10 runs, then 1 in 12, on a loaded 2-core machine; the training loop one run in three once), whether or not it called
``destroy_process_group()``, which destroys gloo's backend, and joins its workers, only if nothing else holds the
group, and a jitted module's traces hold it until the interpreter tears them down. Gloo has no other way to stop
or join its workers (its ``shutdown()`` and ``abort()`` do nothing in torch 2.11).

What this module does: :func:`install` registers an exit hook once (``import fsdp_pass`` does it). At exit, with
the interpreter still whole, the hook waits, sleeping (the GIL released), until every gloo worker thread of this
process is blocked (parked until its next collective) at :data:`SETTLE_POLLS` looks in a row, :data:`POLL_S` apart:
a worker still releasing a finished collective is running or waiting for a core, or waits for the GIL, which it
gets while the hook sleeps (from another Python thread holding it, a switch interval after asking: Python's
default is 5 ms, one look apart). The threads' states are read from ``/proc/self/task`` (Linux); where there is
none, the hook does nothing. It costs ~15 ms at exit, and nothing where no gloo group was made.

What an upstream fix would be: gloo releasing a work's tensors before it marks the work done, or torch's decref
not waiting for the GIL once the interpreter is finalizing (Python 3.14 parks such threads instead of ending them).
"""

from __future__ import annotations

import atexit
import os
import time

GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads
SETTLE_POLLS = 3  # looks in a row at which every worker must be blocked
POLL_S = 0.005  # between two looks (the GIL released): Python's default switch interval
TIMEOUT_S = 5.0  # at most this long at exit (a worker stuck in a collective whose peer is gone stays so)
_TASKS = "/proc/self/task"
_RUNNING = ("R",)  # /proc/<pid>/task/<tid>/stat states of a thread on a CPU or waiting for one

_installed = False


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # the thread ended
        return None


def gloo_workers() -> list[str]:
    """The thread ids of this process's gloo worker threads (none where ``/proc`` has no task list)."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return []
    return [tid for tid in tids if (_read(f"{_TASKS}/{tid}/comm") or "").strip() == GLOO_WORKER]


def _running(tid: str) -> bool:
    stat = _read(f"{_TASKS}/{tid}/stat")
    # "<tid> (<name>) <state> ...": the name may hold spaces or parentheses; the state follows its last ')'
    return stat is not None and stat[stat.rindex(")") + 2:][:1] in _RUNNING


def wait_for_idle_gloo_workers(timeout_s: float = TIMEOUT_S) -> bool:
    """Return once no gloo worker thread of this process is running or runnable at :data:`SETTLE_POLLS` looks in a
    row, :data:`POLL_S` apart (sleeping in between: the GIL released); False if ``timeout_s`` passed first. True at
    once without workers."""
    deadline = time.monotonic() + timeout_s
    settled = 0
    while settled < SETTLE_POLLS:
        workers = gloo_workers()
        if not workers:
            return True
        settled = 0 if any(_running(tid) for tid in workers) else settled + 1
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


def installed() -> bool:
    """Whether this process has the exit hook."""
    return _installed


def install() -> None:
    """Register the exit hook that waits for idle gloo workers (once per process; later calls do nothing)."""
    global _installed
    if _installed:
        return
    _installed = True
    atexit.register(wait_for_idle_gloo_workers)
