"""Dry runs of the explain tests' model, compiled once per test session and shared by every test module.

A dry run compiles the real step (a few seconds each on this CPU), and several modules read the same one
(e.g. ZeRO-3 at world 8 with default options). Tests only read a ``DryRun``; none may change it.
"""

from __future__ import annotations

import functools

from fsdp_pass.report.dry_run import DryRun, dry_run
from tests import explain_cases


def model_dry_run(world_size: int, strategy: str, **fsdp_kwargs) -> DryRun:
    """``dry_run`` of ``explain_cases.build_model("meta")``; options must be hashable (dtypes, strings, ...)."""
    return _cached(world_size, strategy, tuple(sorted(fsdp_kwargs.items())))


@functools.cache
def _cached(world_size, strategy, options) -> DryRun:
    return dry_run(*explain_cases.build_model("meta"), world_size, strategy, **dict(options))
