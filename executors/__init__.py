"""fsdp_pass_executors: which Thunder executors run the traces the pass produces.

Imported as ``fsdp_pass_executors`` (the folder is ``executors/``). The collectives run on
``fsdp_comm`` (:mod:`fsdp_pass_executors.collectives`: async work handles, a communication stream on
CUDA); the compute between them goes to nvFuser when it is installed for the running torch and a
CUDA device is used, else to Thunder's torch.compile executor on CUDA, else (CPU) to the torch
executor. Collectives are never fused, so they are the boundaries of the fusion regions.
"""

from __future__ import annotations

import torch
from fsdp_pass_executors import accumulation as _accumulation  # noqa: F401 - registers the accumulation ops
from fsdp_pass_executors.collectives import WAIT_CLOCK, comm_ex

__all__ = ["WAIT_CLOCK", "comm_ex", "describe", "executors_for", "nvfuser_available"]

def nvfuser_available() -> bool:
    try:
        from thunder.executors.nvfuserex import nvfuserex
    except Exception:  # nvfuser missing or built for another torch
        return False
    return nvfuserex is not None and torch.cuda.is_available()


def executors_for(device) -> list:
    """The executor list for thunder.jit(..., executors=...) on ``device``: collectives first, then fusion."""
    from thunder.extend import get_executor

    device = torch.device(device)
    if device.type == "cuda" and nvfuser_available():
        return [comm_ex, get_executor("nvfuser"), get_executor("torch")]
    if device.type == "cuda":
        # no nvFuser for this torch: Thunder's torch.compile executor fuses instead
        return [comm_ex, get_executor("torchcompile"), get_executor("torch")]
    # CPU: the torch executor alone (torch.compile would add minutes of compile for tiny kernels)
    return [comm_ex, get_executor("torch")]


def describe(executors) -> str:
    return ", ".join(ex.name for ex in executors)
