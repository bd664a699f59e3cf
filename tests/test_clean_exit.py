"""Ranks exit cleanly after their last collective (fsdp_pass.shard.gloo_exit): 8 trials of two gloo ranks that
finish an all-reduce and exit off the end of their script, each rank starved so that it loses the race that
aborted a rank now and then (tests/exit_trials.py; without the exit hook, 10 of 16 trials lost a rank to SIGABRT
when measured), and every rank's exit code is 0."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fsdp_pass
from fsdp_pass.shard import gloo_exit

TRIALS = 8
LINUX = os.path.isdir("/proc/self/task") and hasattr(os, "fork") and hasattr(os, "sched_setaffinity")


def test_importing_the_package_installs_the_exit_hook():
    assert fsdp_pass._gloo_exit is gloo_exit and gloo_exit.installed()
    assert gloo_exit.wait_for_idle_gloo_workers(timeout_s=1.0)  # no gloo workers here, or idle ones: within 3 looks


@pytest.mark.skipif(not LINUX, reason="the trials pin ranks to cores and read /proc (Linux)")
def test_every_rank_exits_cleanly_after_its_last_collective():
    trials = Path(__file__).with_name("exit_trials.py")
    done = subprocess.run([sys.executable, str(trials), str(TRIALS)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(codes) == TRIALS and codes == [[0, 0]] * TRIALS, (codes, done.stderr[-3000:])
