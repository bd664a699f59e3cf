"""Dry runs of the explain tests' model, compiled once per test session and shared by every test module.

A dry run compiles the real step (a few seconds each on this CPU), and several modules read the same one
(e.g. ZeRO-3 at world 8 with default options). Tests only read a ``DryRun``; none may change it.
"""

from __future__ import annotations

import functools

from fsdp_pass.report.dry_run import DryRun, dry_run
from tests import explain_cases


def model_dry_run(world_size: int, strategy: str, **fsdp_kwargs) -> DryRun:
    """``dry_run`` of ``explain_cases.build_model("meta")``; options must be hashable (dtypes, strings, ...).
    One unit per block unless ``units`` is given (the tests read per-block units; ``units=None``: the step
    model's default choice)."""
    if strategy != "auto":
        fsdp_kwargs.setdefault("units", "blocks")
    fsdp_kwargs = {k: v for k, v in fsdp_kwargs.items() if not (k == "units" and v is None)}
    return _cached(world_size, strategy, tuple(sorted(fsdp_kwargs.items())))


@functools.cache
def _cached(world_size, strategy, options) -> DryRun:
    return dry_run(*explain_cases.build_model("meta"), world_size, strategy, **dict(options))
