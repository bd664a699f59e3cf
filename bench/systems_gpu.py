"""The systems :mod:`bench.gpu` compares, each built on a model already on the device.

A :class:`Trainer` holds what is called (``module``) and its AdamW optimizer; ``predicted()`` gives
``explain()``'s step peak for our rows (empty for the peers). At world size 2 the systems without FSDP
synchronize their gradients as DDP does (eager and compile: ``DistributedDataParallel``; plain thunder: each
gradient all-reduced and averaged after the backward), so every row trains the same model on the same batches.
"""

from __future__ import annotations

import thunder
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from fsdp_pass.api import fsdp_of
from fsdp_pass.plan.unit_policies import BySize
from fsdp_pass.transform import FSDP

LR = 1e-3
SYSTEMS = ("eager", "compile", "fsdp2", "fsdp2+compile", "thunder", "ours zero3", "ours zero2", "ours zero3 merged",
           "ours zero2 merged")
MERGED_UNIT_BYTES = 1 << 20  # the "merged" rows: consecutive blocks merged into units of up to 1 MiB


class Trainer:
    def __init__(self, module, parameters=None):
        self.module = module
        self.optimizer = torch.optim.AdamW(list(parameters or module.parameters()), lr=LR)

    def after_backward(self) -> None:
        """Nothing to do after the backward (the systems here synchronize gradients themselves, or not at all)."""

    def predicted(self) -> dict:
        return {}


class AllReduceTrainer(Trainer):
    """Plain thunder.jit at world size > 1: the gradients averaged over the ranks after each backward."""

    def after_backward(self) -> None:
        for p in self.optimizer.param_groups[0]["params"]:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(dist.get_world_size())


class OursTrainer(Trainer):
    def predicted(self) -> dict:
        return {"predicted_above": fsdp_of(self.module).explain().memory.step.peak_bytes}


def _fsdp2(model, device, compile_layers: bool):
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
        if compile_layers:
            layer.compile()
    fully_shard(model, mesh=mesh)
    return Trainer(model)


def _ddp(model):
    return DistributedDataParallel(model) if dist.get_world_size() > 1 else model


def build_system(name: str, model, device, executors: list) -> Trainer:
    """``executors``: the list the Thunder rows are jitted with (ours puts ``fsdp_comm`` first itself)."""
    if name == "eager":
        return Trainer(_ddp(model))
    if name == "compile":
        return Trainer(torch.compile(_ddp(model)), model.parameters())
    if name == "fsdp2":
        return _fsdp2(model, device, compile_layers=False)
    if name == "fsdp2+compile":
        return _fsdp2(model, device, compile_layers=True)
    if name == "thunder":
        trainer = AllReduceTrainer if dist.get_world_size() > 1 else Trainer
        return trainer(thunder.jit(model, executors=executors))
    if name.startswith("ours "):
        strategy, *merged = name.split()[1:]
        units = BySize(MERGED_UNIT_BYTES) if merged else "blocks"
        return OursTrainer(thunder.jit(model, transforms=[FSDP(strategy, units=units)], executors=executors))
    raise SystemExit(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")
