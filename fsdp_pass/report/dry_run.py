"""A dry run: the traces and the explanation of one FSDP training step at any world size, in one process,
without allocating the model.

``dry_run(module, args, world_size, strategy, kwargs=..., ...) -> DryRun``

1. The module and its example inputs (positional ``args``, keyword ``kwargs``) live on the meta device:
   shapes and dtypes, no storage.
2. A fake process group of ``world_size`` stands in for the ranks (nothing is communicated).
3. ``thunder.jit(module, transforms=[FSDP(..., device="meta")])`` compiles the step as rank 0 would,
   without running it: the same units, collectives, schedule and labels as a real run. ``torch.autocast``
   regions the model opens on the meta device stand for the CPU's (:mod:`fsdp_pass.report.meta_autocast`).
4. It lowers for the target ``device`` (:func:`target_device`: ``"cuda"`` when the cost inputs are a GPU's):
   ``"cpu"`` with the CPU's executors (attention on torch's CPU flash kernel, whose meta implementation
   gives the shapes: the output and a float32 log-sum-exp per row saved for the backward, no probabilities);
   ``"cuda"`` with the executors of ``fsdp_pass_executors.dry_run_choice("cuda")``: attention on Thunder's
   sdpa executor, whose kernel is chosen for meta tensors as torch does on an H100
   (:mod:`fsdp_pass.report.meta_attention`, the one modelled step), and the rest fused by torchcompile.
   ``DryRun.lowering`` says which, in words.
5. A stack of identical layers is interpreted for five of them and the rest copied from layer 3's ops
   (:mod:`fsdp_pass.report.repeated_layers`; most of the time is Thunder's interpreter, layer by layer): the same
   traces, the same printed plan (``trace_every_layer=True`` interprets all; ``DryRun.copied_layers`` says which).
6. :func:`~fsdp_pass.report.explain.explain_step` reads the final traces: per-unit schedule, bytes, predicted memory.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import thunder
import torch
from torch.distributed.device_mesh import init_device_mesh
from fsdp_pass_executors import dry_run_choice

from fsdp_pass.errors import check
from fsdp_pass.models.thunder_gc_guard import gc_guard
from fsdp_pass.report.explain import Explanation, explain_step
from fsdp_pass.cost.cost_model import DEFAULTS
from fsdp_pass.report.meta_attention import sdpa_on_meta_as_cuda
from fsdp_pass.report.meta_autocast import autocast_on_meta_as
from fsdp_pass.report.repeated_layers import traced_once_per_layer_stack
from fsdp_pass.shard.groups import fake_process_group
from fsdp_pass.shard.forward_inputs import inputs_of_step
from fsdp_pass.transform import FSDP


@dataclass(frozen=True)
class DryRun:
    explanation: Explanation
    forward: object  # the final forward trace
    backward: object  # the final backward trace (None when nothing requires grad)
    executors: tuple[str, ...]
    compile_seconds: float
    fsdp: object = None  # the FSDP transform that compiled it (its predict_step(cost) prices the plan)
    device: str = "cpu"  # the device the traces were lowered for ("cpu" or "cuda")
    lowering: str = ""  # what the executors keep, in words (what is traced, what is modelled)
    # e.g. "27 of 32 layers of model.layers copied from layer 3's ops (5 interpreted)", or why none were (the layers
    # do not repeat); "": no stack of identical layers, or every layer asked for
    copied_layers: str = ""

    def predict_step(self, cost=None):
        """The step model's step time and peak for this plan (:func:`fsdp_pass.predict_step`); ``cost`` None:
        an auto plan's own, else the CPU's defaults (a dry run computes on the meta device)."""
        return self.fsdp.predict_step(cost)

    def write(self, folder: str | Path) -> list[Path]:
        """Write ``forward_trace.py``, ``backward_trace.py`` and ``explain.txt`` (ending with a line that says what the
        traces were lowered for) into ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        footer = f"\n(lowered for {self.device}: {self.lowering})\n" if self.lowering else ""
        files = {"explain.txt": str(self.explanation) + "\n" + footer, "forward_trace.py": str(self.forward) + "\n"}
        if self.backward is not None:
            files["backward_trace.py"] = str(self.backward) + "\n"
        for name, text in files.items():
            (folder / name).write_text(text)
        return [folder / name for name in files]


def _check_on_meta(module: torch.nn.Module) -> None:
    tensors = list(module.parameters()) + list(module.buffers())
    check(
        all(t.is_meta for t in tensors),
        "A dry run traces a model on the meta device, and this one has tensors with storage.",
        "Build it under `with torch.device('meta'):` (nothing is allocated), or use fsdp_pass.models.zoo.build(spec).",
    )


DEVICES = ("cuda", "cpu")


def target_device(cost=None) -> str:
    """The device a dry run lowers for by default: ``"cuda"`` when the cost inputs (a name of
    :data:`~fsdp_pass.cost.cost_model.DEFAULTS` or a ``CostInputs``) are a GPU's, i.e. their host queues work ahead
    of the device (CUDA streams); else ``"cpu"`` (also with no cost inputs)."""
    inputs = DEFAULTS.get(cost) if isinstance(cost, str) else cost
    return "cuda" if getattr(inputs, "host_async", False) else "cpu"


def _input_on_meta(value):
    return torch.empty_like(value, device="meta") if isinstance(value, torch.Tensor) else value


def _check_dry_run_inputs(module: torch.nn.Module, world_size, mesh, device: str) -> None:
    """``FSDPError`` unless the world size, mesh and device make a dry run and ``module`` is on the meta device."""
    check(
        isinstance(world_size, int) and world_size >= 1,
        f"world_size must be a positive int, got {world_size!r}.",
        "Pass the number of ranks to plan for, e.g. 64.",
    )
    check(
        mesh is None or (len(mesh) == 2 and mesh[0] * mesh[1] == world_size),
        f"mesh={mesh!r} is not (replicas, shard size) of {world_size} ranks.",
        f"Pass two numbers whose product is the world size, e.g. mesh=(8, {max(world_size // 8, 1)}).",
    )
    check(
        device in DEVICES,
        f"A dry run lowers for {' or '.join(map(repr, DEVICES))}, not {device!r}.",
        "Pass device='cuda' (fused attention, the fusion executor) or device='cpu' (the CPU's executors).",
    )
    _check_on_meta(module)


def dry_run(
    module: torch.nn.Module,
    args: tuple,
    world_size: int,
    strategy: str = "zero3",
    *,
    kwargs: dict | None = None,
    executors=None,
    device: str | None = None,
    optimizer="adam",
    mesh: tuple[int, int] | None = None,
    trace_every_layer: bool = False,
    **fsdp_kwargs,
) -> DryRun:
    """Compile one step of ``module(*args, **kwargs)`` as rank 0 of ``world_size`` ranks would, and explain it.

    ``kwargs``: the model's keyword inputs (e.g. ``{"input_ids": ..., "labels": ...}``); ``device``: the device
    to lower for, ``"cuda"`` or ``"cpu"`` (None: :func:`target_device` of ``fsdp_kwargs``' ``cost``); ``executors``:
    Thunder executors to lower with (default: the dry run's list for ``device``); ``mesh``: ``(replicas, shard size)``
    for HSDP on a 2-D mesh of ``world_size`` ranks (None: FSDP over all of them); ``trace_every_layer``: have Thunder
    interpret every layer of a stack of identical layers (False: five of them, the rest copied, the same traces
    in a fraction of the time: :mod:`fsdp_pass.report.repeated_layers`); ``fsdp_kwargs`` go to
    :class:`~fsdp_pass.FSDP` (``units``, ``schedule``, ``reshard_after_forward``, ...).
    """
    device = device if device is not None else target_device(fsdp_kwargs.get("cost"))
    _check_dry_run_inputs(module, world_size, mesh, device)
    args = tuple(map(_input_on_meta, args))
    kwargs = {name: _input_on_meta(value) for name, value in (kwargs or {}).items()}
    chosen, lowering = dry_run_choice(device)
    if executors is None:
        executors = chosen
    else:
        lowering = f"the executors given ({', '.join(e.name for e in executors)})"
    if str(strategy).lower() == "auto" and isinstance(optimizer, str):  # the auto plan prices the same optimizer
        fsdp_kwargs.setdefault("optimizer", optimizer)
    t0 = time.perf_counter()
    with ExitStack() as stack:
        stack.enter_context(fake_process_group(world_size))
        stack.enter_context(autocast_on_meta_as("cpu"))
        stack.enter_context(gc_guard())  # as FSDP's compiles (models/thunder_gc_guard.py)
        if device == "cuda":
            stack.enter_context(sdpa_on_meta_as_cuda())
        copied = stack.enter_context(traced_once_per_layer_stack(module)) if not trace_every_layer else None
        if mesh is not None:
            fsdp_kwargs["mesh"] = init_device_mesh("cpu", tuple(mesh), mesh_dim_names=("replicate", "shard"))
        fsdp = FSDP(strategy, device="meta", **fsdp_kwargs)
        jm = thunder.jit(module, transforms=[fsdp], executors=executors)
        args, kwargs = inputs_of_step(args, kwargs, fsdp.options.mixed_precision)  # as the jitted module's call
        thunder.compile_data(jm).get_computation_and_inputs(*args, **kwargs)
    seconds = time.perf_counter() - t0
    step = fsdp.compiled_step
    copies = str(copied) if copied is not None else ""
    return DryRun(explain_step(step, optimizer), step.forward, step.backward, tuple(e.name for e in executors), seconds,
                  fsdp, device, lowering, copies)
