"""The systems :mod:`bench.gpu` compares, each built on a model already on the device.

A :class:`Trainer` holds what is called (``module``) and its AdamW optimizer; ``predicted()`` gives, for our
rows (empty for the peers), ``explain()``'s step peak read off the traces, and the auto planner's step model on
the row's plan (``fsdp_pass.predict_step``): its step time and its peak. At world size 2 the systems without FSDP
synchronize their gradients as DDP does (eager and compile: ``DistributedDataParallel``; plain thunder: each
gradient all-reduced and averaged after the backward), so every row trains the same model on the same batches.

A :class:`Setup` says how every row wraps the model: the dtype policy (:mod:`bench.precision`: ours and FSDP2 get
its mixed-precision policy, the rows without FSDP its autocast), whether each decoder layer's activations are
recomputed in the backward (ours: ``FSDP(checkpoint_activations=True)``; the others: ``checkpoint_wrapper`` on each
decoder layer, torch.utils.checkpoint without reentrance), and where the decoder layers are (FSDP2's units).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import thunder
import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing, checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from bench.precision import Precision
from fsdp_pass.api import fsdp_of
from fsdp_pass.errors import FSDPError
from fsdp_pass.models.hf_tracing import trace_hf_models
from fsdp_pass.plan.unit_policies import BySize
from fsdp_pass.transform import FSDP

LR = 1e-3
SYSTEMS = ("eager", "compile", "fsdp2", "fsdp2+compile", "thunder", "ours zero3", "ours zero2", "ours zero3 merged",
           "ours zero2 merged", "ours zero3 default", "ours zero2 default", "ours zero3 merged 512KiB",
           "ours zero3 merged 4MiB", "ours auto", "ours auto probed", "ours zero3 int8", "ours zero3 float8",
           "ours zero3 resharded")
MERGED_UNIT_BYTES = 1 << 20  # the "merged" rows: consecutive blocks merged into units of up to 1 MiB


@dataclass(frozen=True)
class Setup:
    precision: Precision
    checkpoint: bool  # recompute each decoder layer's activations in the backward
    layers_of: Callable  # model -> the nn.ModuleList of its decoder layers


class Trainer:
    """``autocast``: a function returning the context the forward and loss run in (the recipe's rows without FSDP:
    ``torch.autocast``)."""

    def __init__(self, module, parameters=None, autocast=contextlib.nullcontext):
        self.module = module
        self.optimizer = torch.optim.AdamW(list(parameters or module.parameters()), lr=LR)
        self.autocast = autocast

    def loss(self, workload, batch):
        """One forward and its loss (``workload.loss``) in this row's autocast context."""
        with self.autocast():
            return workload.loss(self.module, batch)

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
        explanation = fsdp.explain()
        out = {"predicted_above": explanation.memory.step.peak_bytes, "report": f"{explanation}\n"}
        try:
            model = fsdp.predict_step(self.cost)
        except FSDPError as e:  # a plan the step model cannot price (e.g. checkpointed units): no model columns
            return out | {"report": f"{explanation}\n\nstep model: {str(e).splitlines()[0]}\n"}
        before_step = fsdp.compiled_step.plan.summary.state_bytes  # shards and AdamW state (no offload here)
        return out | {"model_ms": model.step_s * 1e3, "model_peak": model.peak_bytes,
                      "model_step_peak": model.peak_bytes - before_step,
                      "report": f"{explanation}\n\nstep model, {self.cost}:\n{model}\n"}


def _fsdp2(model, device, compile_layers: bool, setup: Setup):
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = setup.precision.fsdp2_policy()
    for layer in setup.layers_of(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
        if compile_layers:
            layer.compile()
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return Trainer(model)


def _ddp(model):
    return DistributedDataParallel(model) if dist.get_world_size() > 1 else model


def _checkpoint_layers(model, layers_of) -> None:
    """Wrap each decoder layer in ``checkpoint_wrapper`` (in place: the layer list then holds the wrappers)."""
    layers = {id(layer) for layer in layers_of(model)}
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: id(m) in layers)


def _ours(strategy: str, setup: Setup, gather_dtype: torch.dtype | None = None, **options) -> FSDP:
    mixed_precision = setup.precision.ours()
    if gather_dtype is not None:  # the 8-bit gather rows: the recipe's casts, parameters gathered in 8 bits
        if mixed_precision is None:
            raise FSDPError("the 8-bit gather rows ('ours zero3 int8', 'ours zero3 float8') need --recipe: "
                            "they quantize the bfloat16 gather of MixedPrecision")
        mixed_precision = dataclasses.replace(mixed_precision, gather_dtype=gather_dtype)
    return FSDP(strategy, mixed_precision=mixed_precision, checkpoint_activations=setup.checkpoint, **options)


def build_system(name: str, model, device, executors: list, costs, setup: Setup) -> Trainer:
    """``executors``: the list the Thunder rows are jitted with (ours puts ``fsdp_comm`` first itself); ``costs``:
    ``costs.for_prices()`` what the step model prices our rows with, ``costs.probed()`` a probe of these ranks
    (what ``ours auto probed`` plans with); ``setup``: the dtype policy, checkpointing and decoder layers."""
    if name not in SYSTEMS:
        raise SystemExit(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")
    if setup.checkpoint and not name.startswith("ours "):
        _checkpoint_layers(model, setup.layers_of)
    autocast = lambda: setup.precision.autocast(device)  # noqa: E731 - the rows without FSDP
    if name == "eager":
        return Trainer(_ddp(model), autocast=autocast)
    if name == "compile":
        return Trainer(torch.compile(_ddp(model)), model.parameters(), autocast=autocast)
    if name == "fsdp2":
        return _fsdp2(model, device, compile_layers=False, setup=setup)
    if name == "fsdp2+compile":
        return _fsdp2(model, device, compile_layers=True, setup=setup)
    if name == "thunder":
        trainer = AllReduceTrainer if dist.get_world_size() > 1 else Trainer
        # transformers 5's HF models need the lookasides FSDP adds to its own rows (models/hf_output_capture.py)
        return trainer(trace_hf_models(thunder.jit(model, executors=executors)), autocast=autocast)
    if name in ("ours auto", "ours auto probed"):
        cost = costs.probed() if name.endswith("probed") else None  # None: the device's defaults
        jitted = thunder.jit(model, transforms=[_ours("auto", setup, cost=cost)], executors=executors)
        return OursTrainer(jitted, costs.for_prices())
    strategy, *how = name.split()[1:]
    gather_dtype = {"int8": torch.int8, "float8": torch.float8_e4m3fn}.get(how[0]) if how else None
    if gather_dtype is not None:  # the 8-bit gather rows: the step model's default units
        how = ["default"]
    sizes = {"512KiB": 1 << 19, "4MiB": 1 << 22}  # the "merged" rows at other unit sizes
    units = {"merged": BySize(sizes[how[-1]] if how[1:] else MERGED_UNIT_BYTES), "default": None}.get(
        how[0], "blocks") if how else "blocks"
    options = {} if units is None else {"units": units}  # None: units= left out, the step model chooses them
    if how == ["resharded"]:  # every unit resharded after forward, the last one too
        options["reshard_after_forward"] = True
    jitted = thunder.jit(model, transforms=[_ours(strategy, setup, gather_dtype, **options)], executors=executors)
    return OursTrainer(jitted, costs.for_prices())
