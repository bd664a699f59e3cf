"""The systems :mod:`bench.gpu` compares, each built on a model already on the device.

A :class:`Trainer` holds what is called (``module``) and its AdamW optimizer; ``predicted()`` gives, for our
rows (empty for the peers), ``explain()``'s step peak read off the traces, and the auto planner's step model on
the row's plan (``fsdp_pass.predict_step``): its step time and its peak. At world size 2 the systems without FSDP
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
           "ours zero2 merged", "ours auto", "ours auto probed")
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
    def __init__(self, module, cost):
        super().__init__(module)
        self.cost = cost  # what the step model prices this plan with

    def predicted(self) -> dict:
        fsdp = fsdp_of(self.module)
        model = fsdp.predict_step(self.cost)
        before_step = fsdp.compiled_step.plan.summary.state_bytes  # shards and AdamW state (no offload here)
        explanation = fsdp.explain()
        return {"predicted_above": explanation.memory.step.peak_bytes, "model_ms": model.step_s * 1e3,
                "model_peak": model.peak_bytes, "model_step_peak": model.peak_bytes - before_step,
                "report": f"{explanation}\n\nstep model, {self.cost}:\n{model}\n"}


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


def build_system(name: str, model, device, executors: list, costs) -> Trainer:
    """``executors``: the list the Thunder rows are jitted with (ours puts ``fsdp_comm`` first itself); ``costs``:
    ``costs.for_prices()`` what the step model prices our rows with, ``costs.probed()`` a probe of these ranks
    (what ``ours auto probed`` plans with)."""
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
    if name in ("ours auto", "ours auto probed"):
        fsdp = FSDP("auto", cost=costs.probed() if name.endswith("probed") else None)  # None: the device's defaults
        return OursTrainer(thunder.jit(model, transforms=[fsdp], executors=executors), costs.for_prices())
    if name.startswith("ours "):
        strategy, *merged = name.split()[1:]
        units = BySize(MERGED_UNIT_BYTES) if merged else "blocks"
        jitted = thunder.jit(model, transforms=[FSDP(strategy, units=units)], executors=executors)
        return OursTrainer(jitted, costs.for_prices())
    raise SystemExit(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")
