"""What the rank pool runs for tests/test_loop.py: ``fsdp_pass.loop`` on this pool's ranks."""

from __future__ import annotations

import torch.distributed as dist

from fsdp_pass.errors import FSDPError


def run_loop(argv: list[str]) -> dict:
    """``loop.run_training`` with ``argv``: its :class:`~fsdp_pass.train.progress.LoopRun`, the lines rank 0
    printed, or the FSDPError it raised (then ``run`` is None)."""
    from fsdp_pass import loop

    lines: list[str] = []
    say = (lambda *a, **k: lines.append(" ".join(map(str, a)))) if dist.get_rank() == 0 else (lambda *a, **k: None)
    try:
        return {"run": loop.run_training(loop.arguments(argv), say=say), "lines": lines, "error": None}
    except FSDPError as e:
        return {"run": None, "lines": lines, "error": str(e)}
