"""fsdp_pass_executors: which Thunder executors run the traces the pass produces.

Imported as ``fsdp_pass_executors`` (the folder is ``executors/``). Collectives and the copies
around them run on Thunder's torch executor (its ``torch_all_gather_prim_impl`` and friends); the
compute between them goes to nvFuser when it is installed for the running torch and a CUDA device is
used, else to the torch executor.
"""

from __future__ import annotations

import torch


def nvfuser_available() -> bool:
    try:
        from thunder.executors.nvfuserex import nvfuserex
    except Exception:  # nvfuser missing or built for another torch
        return False
    return nvfuserex is not None and torch.cuda.is_available()


def executors_for(device) -> list:
    """The executor list for thunder.jit(..., executors=...) on ``device``: nvFuser first when usable."""
    from thunder.extend import get_executor

    device = torch.device(device)
    if device.type == "cuda" and nvfuser_available():
        return [get_executor("nvfuser"), get_executor("torch")]
    if device.type == "cuda":
        # no nvFuser for this torch: Thunder's torch.compile executor fuses instead
        return [get_executor("torchcompile"), get_executor("torch")]
    # CPU: the torch executor alone (torch.compile would add minutes of compile for tiny kernels)
    return [get_executor("torch")]


def describe(executors) -> str:
    return ", ".join(ex.name for ex in executors)
