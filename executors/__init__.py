"""fsdp_pass_executors: which Thunder executors run the traces the pass produces.

Imported as ``fsdp_pass_executors`` (the folder is ``executors/``). The collectives and the ops that pack
and unpack their buffers run on ``fsdp_comm`` (:mod:`fsdp_pass_executors.collectives`: async work handles,
a communication stream on CUDA; :mod:`fsdp_pass_executors.buffers`; :mod:`fsdp_pass_executors.quantized_buffers`; :mod:`fsdp_pass_executors.accumulation`).
The compute between them goes to a fusion executor on CUDA: nvFuser when a wheel built for the running
torch is installed, else Thunder's torch.compile executor; on CPU to the torch executor, and attention to
``cpu_attention`` (:mod:`fsdp_pass_executors.cpu_attention`: torch's CPU flash kernel, as eager PyTorch runs
it; on CUDA to Thunder's sdpa executor). ``fsdp_comm``'s ops are never fused, so they are the boundaries of
the fusion regions. ``executor_choice(device)`` says which list and why; ``FSDP`` puts ``fsdp_comm`` first
in any list it is given. ``dry_run_choice(device)``: the list a dry run (which traces on the meta device,
here) lowers with to keep what ``device``'s list keeps.
"""

from __future__ import annotations

import torch
from thunder.extend import get_executor

from fsdp_pass_executors import accumulation as _accumulation  # noqa: F401 - registers the accumulation ops
from fsdp_pass_executors import buffers as _buffers  # noqa: F401 - registers the pack / unpack ops
from fsdp_pass_executors import quantized_buffers as _quantized  # noqa: F401 - registers the 8-bit gather's ops
from fsdp_pass_executors.collectives import WAIT_CLOCK, comm_ex
from fsdp_pass_executors.cpu_attention import cpu_attention_ex

__all__ = [
    "WAIT_CLOCK", "comm_ex", "cpu_attention_ex", "describe", "dry_run_choice", "executor_choice", "executors_for",
    "nvfuser_available",
]


def nvfuser_available() -> bool:
    """nvFuser imports (its wheel matches this torch) and a GPU is there."""
    try:
        from thunder.executors.nvfuserex import nvfuserex  # optional: absent without a matching wheel
    except Exception:  # nvfuser missing or built for another torch
        return False
    return nvfuserex is not None and torch.cuda.is_available()


def executor_choice(device) -> tuple[list, str]:
    """(the executor list for ``thunder.jit(..., executors=...)`` on ``device``, why it is that list)."""
    device = torch.device(device)
    # on CUDA, attention runs torch's flash / memory-efficient kernels (Thunder's sdpa executor): decomposed,
    # it would save every layer's attention probabilities for the backward
    if device.type == "cuda" and nvfuser_available():
        why = "CUDA with nvFuser installed for this torch; attention on torch's fused SDPA kernels"
        return [comm_ex, get_executor("sdpa"), get_executor("nvfuser"), get_executor("torch")], why
    if device.type == "cuda":
        why = (
            f"CUDA, and no nvFuser built for torch {torch.__version__.split('+')[0]} is installed (its wheels are "
            "built per torch version, see the README): Thunder's torch.compile executor fuses instead; attention "
            "on torch's fused SDPA kernels"
        )
        return [comm_ex, get_executor("sdpa"), get_executor("torchcompile"), get_executor("torch")], why
    why = (
        "CPU: attention on torch's CPU flash kernel (cpu_attention: keeps a log-sum-exp per row, not the "
        "probabilities), the rest on the torch executor (torch.compile would spend minutes compiling kernels "
        "this small)"
    )
    return [comm_ex, cpu_attention_ex, get_executor("torch")], why


def executors_for(device) -> list:
    """The executor list for thunder.jit(..., executors=...) on ``device``: collectives first, then fusion."""
    return executor_choice(device)[0]


def dry_run_choice(device) -> tuple[list, str]:
    """(the executor list a dry run lowers its meta-device traces with to stand for ``device``'s, what it keeps).

    For CUDA: Thunder's sdpa executor (its kernel chosen for meta tensors as on an H100, see
    ``fsdp_pass.report.meta_attention``) and Thunder's torchcompile as the fusion executor, CUDA's list where
    nvFuser is not installed. nvFuser's fusion pass wants CUDA tensors, so a dry run cannot trace it; where the
    GPU has it, it fuses its own regions. For the CPU: the CPU's list (``cpu_attention`` takes meta tensors).
    """
    device = torch.device(device)
    if device.type == "cuda":
        why = (
            "as on CUDA: attention on the sdpa executor's fused kernel (the kernel torch would pick on an H100, "
            "modelled), the rest fused by torchcompile (CUDA's fusion executor without nvFuser; nvFuser cannot "
            "be traced on meta)"
        )
        return [comm_ex, get_executor("sdpa"), get_executor("torchcompile"), get_executor("torch")], why
    why = (
        "as on the CPU: attention on the CPU flash kernel (cpu_attention, whose torch kernels trace on meta), "
        "the rest on the torch executor"
    )
    return executor_choice(device)[0], why


def describe(executors) -> str:
    return ", ".join(ex.name for ex in executors)
