"""Rank functions for tests/test_quantized_gather.py: 8-bit parameter gathers on gloo ranks against one process, and
a real step's memory against explain()'s and the step model's.

The reference quantizes the way the pass documents (:mod:`fsdp_pass.plan.quantized_layout`), written out here
from the documented rule rather than with the pass's layout code: each parameter zero-padded to whole rows per
rank, each rank's part cut into blocks of ``block`` elements, ``scale = amax(|x|) / qmax`` per block, codes
``x / scale`` (rounded and clamped to +-127 in int8; clamped to +-448 and cast in float8_e4m3fn), values
``codes * scale`` in float32, then cast to the compute dtype.
"""

from __future__ import annotations

import copy

import thunder
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fsdp_pass_executors import executors_for

from fsdp_pass_executors.collectives import watching_issues

from fsdp_pass import FSDP, FSDPError, MixedPrecision, explain, fsdp_of, full_state_dict, predict_step
from fsdp_pass.op_names import ALL_GATHER
from fsdp_pass.report.measure import CollectiveBytes, allocated_during
from fsdp_pass.shard.global_view import gather_full
from tests import explain_cases, hsdp_cases, models

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


class TiedMLP(torch.nn.Module):
    """``models.MLP`` with ``fc2`` reading ``fc1``'s weight (a tied parameter, in one unit: see the test module on
    why), batches and loss as ``"mlp"``'s."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
        self.fc2.weight = self.fc1.weight

    def forward(self, x):
        return self.head(x + self.fc2(F.gelu(self.fc1(x))))


def _build(model_name: str) -> torch.nn.Module:
    if model_name == "tied_mlp":
        torch.manual_seed(0)
        return TiedMLP()
    return models.build(model_name)


def dequantized(full: torch.Tensor, shard_ranks: int, block: int, qdtype, dtype) -> torch.Tensor:
    """``full`` (float32) as every rank sees it after a quantized gather over ``shard_ranks`` ranks (``qdtype``
    None: an unquantized gather, cast to ``dtype``)."""
    if qdtype is None:
        return full.to(dtype)
    shape = tuple(full.shape)
    rows = shape[0] if shape else 1
    per_rank = -(-rows // shard_ranks)
    matrix = full.reshape(rows, -1)
    padded = torch.cat([matrix, matrix.new_zeros(per_rank * shard_ranks - rows, matrix.shape[1])])
    parts = []
    for part in padded.reshape(shard_ranks, -1):  # each rank's shard, flat
        n = part.numel()
        blocks = F.pad(part, (0, -(-n // block) * block - n)).view(-1, block)
        scale = blocks.abs().amax(dim=1) / QMAX[qdtype]
        scaled = blocks / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]
        qmax = QMAX[qdtype]
        codes = scaled.round().clamp(-qmax, qmax).to(qdtype) if qdtype == torch.int8 else scaled.clamp(-qmax, qmax).to(qdtype)
        parts.append((codes.to(torch.float32) * scale[:, None]).reshape(-1)[:n].to(dtype))
    return torch.cat(parts).reshape(per_rank * shard_ranks, -1)[:rows].reshape(shape)


class _Reference:
    """One process, every rank's slice: the float32 master weights (``reference``) quantized and dequantized as
    above into a ``param_dtype`` copy that plain Thunder runs, each slice's gradients divided by the ranks and
    summed in float32. The copy unties tied parameters, as FSDP packs each use of one in its unit's buffer and
    reduces its gradient on its own: the master's gradient is the float32 sum of its uses' (bitwise the same in
    either order: two terms)."""

    def __init__(self, reference, shard_ranks, block, gather_dtype, param_dtype):
        self.reference, self.shard_ranks, self.block = reference, shard_ranks, block
        self.gather_dtype, self.param_dtype = gather_dtype, param_dtype
        self.uses = list(reference.named_parameters(remove_duplicate=False))  # (name, master), tied ones twice
        self.low = copy.deepcopy(reference)
        for name, master in self.uses:
            module, _, attr = name.rpartition(".")
            setattr(self.low.get_submodule(module), attr,
                    torch.nn.Parameter(master.detach().to(param_dtype), requires_grad=master.requires_grad))
        self.low_params = [self.low.get_parameter(name) for name, _ in self.uses]
        self.jitted = thunder.jit(self.low, executors=executors_for("cpu"))

    def step(self, data: str, x, y, world: int) -> tuple[list[float], int]:
        """Gradients into the masters' ``.grad``; returns each slice's loss, and how many parameter elements the
        quantization rounded to other values than a plain ``param_dtype`` cast would."""
        rounded = 0
        with torch.no_grad():
            for (_, master), q in zip(self.uses, self.low_params):
                q.copy_(dequantized(master.detach(), self.shard_ranks, self.block, self.gather_dtype, self.param_dtype))
                rounded += int((q != master.detach().to(self.param_dtype)).sum())
        losses, sums = [], [None] * len(self.uses)
        for r in range(world):
            xr = x[2 * r : 2 * r + 2]
            loss = models.loss_fn(data, self.jitted(xr.to(self.param_dtype) if xr.is_floating_point() else xr).float(),
                                  y[2 * r : 2 * r + 2])
            loss.backward()
            losses.append(float(loss.detach()))
            for i, q in enumerate(self.low_params):
                if q.grad is not None:
                    part = q.grad.float() / world
                    sums[i] = part if sums[i] is None else sums[i] + part
                    q.grad = None
        for master in self.reference.parameters():
            master.grad = None
        for (_, master), total in zip(self.uses, sums):
            if total is not None:
                master.grad = total if master.grad is None else master.grad + total
        return losses, rounded


def quantized_parity(model_name: str, strategy: str, gather_dtype, steps: int = 3, mesh_shape=None,
                     param_dtype=torch.bfloat16, block: int = 128, **fsdp_kwargs) -> dict:
    """Train ``model_name`` with ``MixedPrecision(param_dtype, gather_dtype=...)`` on this rank's slice, and
    :class:`_Reference` on every slice, the same AdamW on both. ``mesh_shape``: HSDP's (replicas, shard size)
    (None: every rank shards). Returns, per step, whether this rank's loss differs at all (bitwise) from the
    reference's on its slice and which gathered gradients differ (with their relative error); which master weights
    differ after the steps; what one more step's all-gathers sent; the step's printed forward trace."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = None if mesh_shape is None else hsdp_cases.mesh_of(mesh_shape)
    precision = MixedPrecision(param_dtype, output_dtype=torch.float32, gather_dtype=gather_dtype, gather_block=block)
    master = _build(model_name)
    data = "mlp" if model_name == "tied_mlp" else model_name
    transform = FSDP(strategy, mixed_precision=precision, **({"mesh": mesh} if mesh is not None else {}), **fsdp_kwargs)
    jm = thunder.jit(copy.deepcopy(master), transforms=[transform], executors=executors_for("cpu"))
    fsdp = fsdp_of(jm)
    reference = _Reference(master, world if mesh_shape is None else mesh_shape[1], block, gather_dtype, param_dtype)
    opt = torch.optim.AdamW(jm.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in master.parameters() if p.requires_grad], lr=1e-2)
    named = dict(master.named_parameters())

    out = {"loss_differs": [], "grad_differs": [], "rounded": 0, "losses": []}
    for step in range(steps):
        x, y = models.batch(data, 2 * world, step)
        ref_losses, rounded = reference.step(data, x, y, world)
        out["rounded"] += rounded
        loss = models.loss_fn(data, jm(x[2 * rank : 2 * rank + 2]), y[2 * rank : 2 * rank + 2])
        loss.backward()
        out["losses"].append(float(loss.detach()))
        out["loss_differs"].append(float(loss.detach()) != ref_losses[rank])
        differs = []
        for spec in fsdp.sharding.owners():
            if spec.requires_grad:
                full_grad = gather_full(jm.get_parameter(spec.name).grad, spec.layout, fsdp.group)
                ref = named[spec.name].grad
                differs += [] if torch.equal(full_grad, ref) else [
                    (spec.name, float((full_grad - ref).abs().max() / ref.abs().max()))]
        out["grad_differs"].append(differs)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()

    full = full_state_dict(jm)
    out["params_differ"] = sorted(n for n, p in named.items() if not torch.equal(full[n], p.detach()))
    with CollectiveBytes() as sent:
        models.loss_fn(data, jm(x[2 * rank : 2 * rank + 2]), y[2 * rank : 2 * rank + 2]).backward()
    out["gather_bytes"] = sorted(n for kind, n in sent.calls if kind is ALL_GATHER)
    out["frozen_grads"] = [n for n, p in jm.named_parameters() if not p.requires_grad and p.grad is not None]
    out["forward"] = str(fsdp.compiled_step.forward)
    return out


def measured_step(strategy: str, gather_dtype, param_dtype=torch.bfloat16, steps: int = 3) -> dict:
    """explain()'s test model (:mod:`tests.explain_cases`, one unit per block) computing in ``param_dtype`` (None: in
    float32) with 8-bit gathers, trained with AdamW: what ``steps`` steps after two warm-up ones allocate (measured),
    explain()'s traced step peak, whole peak and text, the step model's peak (``predict_step``), the bytes of all
    parameters in the compute dtype, and per all-gather of the measured steps whether it filled the buffer its
    quantize op wrote into (its output and input share storage)."""
    module, args = explain_cases.build_model()
    numel = sum(p.numel() for p in module.parameters())  # unsharded (the transform shards the module's own)
    precision = MixedPrecision(param_dtype, output_dtype=torch.float32, gather_dtype=gather_dtype)
    jm = thunder.jit(module, transforms=[FSDP(strategy, units="blocks", mixed_precision=precision)],
                     executors=executors_for("cpu"))
    opt = torch.optim.AdamW(jm.parameters(), lr=1e-3)
    in_place, peaks = [], []

    def watch(kind, out, inp, group, call):
        if kind is ALL_GATHER:
            in_place.append(out.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr())
        return call()

    for i in range(2 + steps):  # two warm-up steps: compile, then the optimizer's state exists
        opt.zero_grad(set_to_none=True)
        if i < 2:
            jm(*args).backward()
        else:
            with watching_issues(watch):
                peaks.append(allocated_during(lambda: jm(*args).backward()).peak_bytes)
        opt.step()
    e = explain(jm)
    return {"measured": peaks, "traced_step": e.memory.step.peak_bytes, "traced": e.memory.peak,
            "predicted": predict_step(jm).peak_bytes, "in_place": in_place, "text": str(e),
            "held": numel * (param_dtype or torch.float32).itemsize}


def inf_in_a_shard(poisoned_rank: int = 1) -> dict:
    """The MLP under ZeRO-3 with int8 gathers and ``check_finite=True``: a clean step, then an inf planted in
    ``poisoned_rank``'s shard of ``fc2.weight`` (its own 8-bit gather reads it): what each rank raises."""
    rank, world = dist.get_rank(), dist.get_world_size()
    precision = MixedPrecision(torch.bfloat16, output_dtype=torch.float32, gather_dtype=torch.int8)
    jm = thunder.jit(models.build("mlp"), transforms=[FSDP("zero3", units="blocks", mixed_precision=precision,
                                                           check_finite=True)], executors=executors_for("cpu"))
    x, y = models.batch("mlp", 2 * world, 0)

    def step() -> str:
        try:
            models.loss_fn("mlp", jm(x[2 * rank : 2 * rank + 2]), y[2 * rank : 2 * rank + 2]).backward()
        except FSDPError as e:
            return str(e)
        return "ok"

    clean = step()
    with torch.no_grad():
        if rank == poisoned_rank:
            jm.get_parameter("fc2.weight").view(-1)[5] = float("inf")
    return {"clean": clean, "poisoned": step(), "forward": str(fsdp_of(jm).compiled_step.forward)}
