"""The main job (:mod:`fsdp_pass.demo`) run on every rank of a gloo RankPool, in the pool's own process group."""

from __future__ import annotations

import contextlib
import io

from fsdp_pass import demo


def run_demo(argv: list[str]) -> str:
    """``python -m fsdp_pass.demo ARGV`` on this rank; what it printed (rank 0 prints, the others do not)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        demo.main(argv)
    return out.getvalue()
