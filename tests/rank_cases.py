"""Functions executed on every rank of a gloo RankPool (module-level so spawned ranks can import them)."""

from __future__ import annotations

import contextlib
import copy

import thunder
import torch
import torch.distributed as dist
from fsdp_pass_executors import executors_for
from thunder.extend import get_executor

from fsdp_pass import FSDP, MixedPrecision, explain, fsdp_of, full_state_dict, load_full_state_dict, no_sync
from fsdp_pass.op_names import REDUCE_SCATTER
from fsdp_pass.plan.layout import ShardLayout, shard_tensor
from fsdp_pass.predicates import is_pack_shards, is_unpack_grad_shard
from fsdp_pass.report.measure import CollectiveBytes, allocated_during
from fsdp_pass.shard.global_view import gather_full
from tests import models


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.to(b.device) - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _worst(errors) -> float:
    """The largest of ``errors``; NaN when any is NaN (Python's max() passes a NaN over when it is not first, and
    a NaN is what a broken step gives)."""
    errors = list(errors)
    return float("nan") if any(e != e for e in errors) else max(errors, default=0.0)


def _norm_rel(ours, theirs) -> float:
    """|ours - theirs| / |theirs|, the tensors taken together as one vector."""
    diff = sum(float((a.to(b.device) - b).double().pow(2).sum()) for a, b in zip(ours, theirs))
    ref = sum(float(b.double().pow(2).sum()) for b in theirs)
    return (diff / max(ref, 1e-30)) ** 0.5


def _reference_and_fsdp_model(
    model_name: str, strategy: str, executor_names=None, device="cpu", model_config=None, **fsdp_kwargs
):
    """(the single-process reference, its FSDP-jitted copy, the FSDP transform), both on ``device``.
    ``executor_names``: Thunder executors by name (default: executors_for(device)); ``model_config``: the model's
    constructor arguments (``models.build``)."""
    reference = models.build(model_name, config=model_config).to(device)
    executors = executors_for(device) if executor_names is None else [get_executor(n) for n in executor_names]
    jm = thunder.jit(copy.deepcopy(reference), transforms=[FSDP(strategy, **fsdp_kwargs)], executors=executors)
    return reference, jm, fsdp_of(jm)


def _local(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    n = t.shape[0] // world_size
    return t[rank * n : (rank + 1) * n]


def _cast_floats(t: torch.Tensor, dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


# (model name, compute dtype, model config) -> (the low-precision copy, its plain-Thunder jit), made once in rank 0's
# process (the only rank that computes the mixed reference): every mixed-precision parity case of that model, config
# and dtype reuses the reference's compile (each step copies the current float32 weights into the copy; the model's buffers are the same
# deterministic ones)
_LOW_PRECISION_COPIES: dict = {}


class _MixedPrecisionReference:
    """What FSDP with ``param_dtype=compute_dtype`` computes, in one process and without FSDP: each rank's
    micro-batch through a copy of the float32 model with its parameters in ``compute_dtype`` and its buffers as
    they are, floating inputs cast to it (jitted by plain Thunder, so both sides
    round the same decomposed ops), outputs back in float32, gradients averaged in float32 into the float32
    master parameters."""

    def __init__(self, model_name, reference, compute_dtype, reduce_dtype=torch.float32, model_config=None):
        self.reference, self.compute_dtype, self.reduce_dtype = reference, compute_dtype, reduce_dtype
        key = (model_name, compute_dtype, tuple(sorted((model_config or {}).items())))
        if key not in _LOW_PRECISION_COPIES:
            low = copy.deepcopy(reference)  # parameters in the compute dtype, buffers as the module defines them
            for q in low.parameters():
                q.data = q.data.to(compute_dtype)
            _LOW_PRECISION_COPIES[key] = low, thunder.jit(low, executors=executors_for("cpu"))
        self.low, self.jitted = _LOW_PRECISION_COPIES[key]

    def step(self, model_name, x, y, world_size, loss_scale: float = 1.0):
        """Gradients (of the loss times ``loss_scale``) into ``reference``'s ``.grad``; returns each rank's loss
        and the largest gradient element any rank computed in the compute dtype (before the reduction)."""
        with torch.no_grad():
            for p, q in zip(self.reference.parameters(), self.low.parameters()):
                q.copy_(p)
                q.grad = None
        losses, sums, largest = [], [None] * len(list(self.low.parameters())), 0.0
        for r in range(world_size):
            out = self.jitted(_cast_floats(_local(x, r, world_size), self.compute_dtype)).float()
            loss = models.loss_fn(model_name, out, _local(y, r, world_size))
            (loss * loss_scale).backward()
            losses.append(loss.detach())
            for i, q in enumerate(self.low.parameters()):  # pre-divided and summed in the reduce dtype
                if q.grad is not None:
                    largest = _worst([largest, float(q.grad.abs().max())])
                    part = q.grad.to(self.reduce_dtype) / world_size
                    sums[i] = part if sums[i] is None else sums[i] + part
                    q.grad = None
        for p, total in zip(self.reference.parameters(), sums):
            if total is not None:
                p.grad = total.float()
        return losses, largest


def _mixed_step_from_rank0(mixed, reference, model_name, x, y, world_size, loss_scale):
    """``mixed.step`` on rank 0 only (a second Thunder compile and every rank's micro-batch, which each rank would
    repeat to the same values), its losses, largest gradient element and the gradients it put into rank 0's
    reference broadcast to every rank's reference."""
    payload = [None]
    if dist.get_rank() == 0:
        losses, largest = mixed.step(model_name, x, y, world_size, loss_scale)
        grads = [None if p.grad is None else p.grad.cpu() for p in reference.parameters()]
        payload = [([loss.cpu() for loss in losses], largest, grads)]
    dist.broadcast_object_list(payload, src=0)
    losses, largest, grads = payload[0]
    device = next(reference.parameters()).device
    if dist.get_rank() != 0:
        for p, g in zip(reference.parameters(), grads):
            p.grad = None if g is None else g.to(device)
    return [loss.to(device) for loss in losses], largest


def parity(
    model_name: str,
    strategy: str,
    steps: int = 5,
    per_rank_batch: int = 2,
    lr: float = 1e-2,
    compute_dtype=None,
    reduce_dtype=torch.float32,
    executor_names=None,
    device="cpu",
    keep_model: bool = False,
    loss_scale: float = 1.0,
    same_batch_on_every_rank: bool = False,
    measure_step: bool = False,
    model_config: dict | None = None,
    **fsdp_kwargs,
):
    """Train the FSDP model and a single-process reference on the same global batches; report errors.
    ``model_config``: the model's constructor arguments (``models.build``; None: its defaults).
    ``device``: where the model computes (``"cuda"``: gloo with CUDA tensors, every rank on one GPU).
    ``keep_model``: the jitted model under ``"jm"`` too, for a caller on the rank that looks further.
    ``loss_scale``: both sides backpropagate the loss times this (gradients compared as they come, scaled).
    ``same_batch_on_every_rank``: every rank's slice of the global batch is the first rank's (so the ranks'
    gradients are equal, and their sum is N times each).
    ``measure_step``: after training, one more forward + backward (the loss too) measured by torch's profiler
    (:func:`measured_step_memory`), next to explain()'s prediction.

    ``compute_dtype``, ``reduce_dtype``: the reference computes like ``MixedPrecision(compute_dtype,
    reduce_dtype)`` (pass the matching ``mixed_precision=`` in ``fsdp_kwargs``).

    Each step: 1. the reference's step on the whole global batch (float32), or the mixed-precision reference's
    (each rank's slice in ``compute_dtype``, gradients pre-divided and summed in ``reduce_dtype``); the reference's
    loss on this rank's slice alone too; 2. this rank's step on its slice; its own loss (before any reduction)
    against the reference's on the slice, the mean over ranks against the reference's loss; 3. every trainable
    parameter's gathered gradient against the reference's, one relative error per parameter; the padding rows
    of every shard exactly zero; 4. both optimizers step."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    reference, jm, fsdp = _reference_and_fsdp_model(
        model_name, strategy, executor_names, device, model_config, **fsdp_kwargs
    )
    opt = torch.optim.AdamW(jm.parameters(), lr=lr)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=lr)
    ref_params = dict(reference.named_parameters())

    trainable = [p for p in reference.parameters() if p.requires_grad]
    mixed = None
    if compute_dtype is not None and rank == 0:  # computed once, on rank 0, and sent to the others (below)
        mixed = _MixedPrecisionReference(model_name, reference, compute_dtype, reduce_dtype, model_config)
    loss_err, local_loss_err, grad_err, norm_err, full_precision_err, losses, frozen_grads = [], [], [], [], [], [], []
    grad_err_by_param: dict[str, float] = {}
    largest_low_precision_grad = 0.0
    for step in range(steps):
        x, y = (t.to(device) for t in models.batch(model_name, per_rank_batch * world_size, 0))  # one fixed batch
        if same_batch_on_every_rank:
            x, y = (torch.cat([t[:per_rank_batch]] * world_size) for t in (x, y))

        ref_opt.zero_grad()
        if compute_dtype is None:
            ref_loss = models.loss_fn(model_name, reference(x), y)
            (ref_loss * loss_scale).backward()
            with torch.no_grad():
                ref_local_loss = models.loss_fn(
                    model_name, reference(_local(x, rank, world_size)), _local(y, rank, world_size)
                )
        else:
            # how far plain float32 gradients are from the mixed-precision reference: the scale of its rounding
            scaled = models.loss_fn(model_name, reference(x), y) * loss_scale
            fp32_grads = torch.autograd.grad(scaled, trainable)
            rank_losses, largest = _mixed_step_from_rank0(mixed, reference, model_name, x, y, world_size, loss_scale)
            largest_low_precision_grad = _worst([largest_low_precision_grad, largest])
            ref_loss, ref_local_loss = sum(rank_losses) / world_size, rank_losses[rank]
            full_precision_err.append(_norm_rel(fp32_grads, [p.grad for p in trainable]))

        opt.zero_grad()
        loss = models.loss_fn(model_name, jm(_local(x, rank, world_size)), _local(y, rank, world_size))
        (loss * loss_scale).backward()
        local_loss_err.append(abs(float(loss.detach()) - float(ref_local_loss)) / abs(float(ref_local_loss)))
        mean_loss = loss.detach().clone()
        ref_loss = ref_loss.detach()
        dist.all_reduce(mean_loss)
        mean_loss /= world_size
        loss_err.append(abs(float(mean_loss) - float(ref_loss)) / abs(float(ref_loss)))
        losses.append(float(mean_loss))

        ours, theirs = [], []
        for spec in fsdp.sharding.owners():
            shard = jm.get_parameter(spec.name)
            if not spec.requires_grad:
                frozen_grads.append(shard.grad is not None)
                continue
            full_grad = gather_full(shard.grad, spec.layout, fsdp.group)
            err = _rel(full_grad, ref_params[spec.name].grad)
            grad_err_by_param[spec.name] = _worst([grad_err_by_param.get(spec.name, 0.0), err])
            ours.append(full_grad)
            theirs.append(ref_params[spec.name].grad)
            # padding rows of the shard stay exactly zero
            pad_start = spec.layout.rows - fsdp.sharding.rank * spec.layout.rows_per_rank  # rank in the shard group
            if 0 <= pad_start < spec.layout.rows_per_rank:
                assert shard.detach().reshape(spec.layout.shard_shape)[pad_start:].abs().max() == 0
        grad_err.append(_worst(grad_err_by_param.values()))  # the worst parameter's, up to this step
        norm_err.append(_norm_rel(ours, theirs))
        opt.step()
        ref_opt.step()

    measured = {} if not measure_step else measured_step_memory(
        jm, opt, model_name, _local(x, rank, world_size), _local(y, rank, world_size)
    )
    # after training, the gathered parameters equal the reference's
    full = full_state_dict(jm)
    param_err = _worst(_rel(full[n], p.detach()) for n, p in ref_params.items())
    return ({"jm": jm} if keep_model else {}) | {
        "loss_rel_err": _worst(loss_err),  # the mean over ranks against the reference's loss
        "local_loss_rel_err": _worst(local_loss_err),  # this rank's own loss against the reference's on its slice
        "grad_rel_err": _worst(grad_err),  # the worst parameter's: max |ours - ref| / max |ref|, each on its own
        "grad_rel_err_by_param": grad_err_by_param,  # each trainable parameter's worst step
        "grad_rel_err_by_step": grad_err,  # the worst parameter's over the steps so far, after each step
        "grad_norm_rel_err": _worst(norm_err),  # all gradients as one vector: |ours - ref| / |ref|
        "full_precision_grad_norm_rel_err": _worst(full_precision_err),
        "largest_low_precision_grad": largest_low_precision_grad,  # the mixed reference's, on any rank
        "param_rel_err": param_err,
        "losses": losses,
        "frozen_grads_present": any(frozen_grads),
        "shard_devices": sorted({str(p.device) for p in jm.parameters()}),
        "grad_devices": sorted({str(p.grad.device) for p in jm.parameters() if p.grad is not None}),
        "optimizer_state_devices": sorted(
            {str(t.device) for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()}
        ),
        "copies": copies_across_devices(jm) if fsdp_kwargs.get("offload_to") else None,  # explain() costs a little
        "shard_numel": sum(p.numel() for p in jm.parameters()),
        "full_shapes": [tuple(p.shape) for p in reference.parameters()],  # tied parameters once
        "unit_names": [u.name for u in fsdp.unit_plan.units],
        # units= left out: what the step model chose (None: units were given)
        "units_choice": None if fsdp.unit_plan.units_choice is None else str(fsdp.unit_plan.units_choice),
        "reshard": [u.reshard_after_forward for u in fsdp.unit_plan.units],
        # where each collective is issued and waited for in this rank's final traces
        "schedule": [(r.phase, r.kind, r.unit, r.issued_at, r.waited_at) for r in fsdp.overlap_report().rows],
        "exposed": [(r.phase, r.kind, r.unit) for r in fsdp.overlap_report().exposed()],
    } | measured


def copies_across_devices(jm) -> dict:
    """Where this rank's last compile moves its shards and gradient shards: the device each ``pack_shards`` op of
    the final forward copies the shards to (``"none"``: packed where they live), the device each
    ``unpack_grad_shard`` of the final backward puts the gradient shards on, and where explain() counts the
    memory: (bytes on the device before the step, bytes on the host, the shards + optimizer state + gradient
    shards). On a CPU-only machine an offloaded step computes on the CPU too, so where a tensor lives says
    nothing: these say whether the offload was planned and put into the traces."""
    forward, backward = thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1]
    m = explain(jm).memory
    return {
        "pack_to": sorted({str(b.args[3]).lower() for b in forward.bound_symbols if is_pack_shards(b)}),
        "unpack_to": sorted({str(b.args[6]).lower() for b in backward.bound_symbols if is_unpack_grad_shard(b)}),
        "memory": (m.before_step, m.host, m.sharded_params + m.optimizer_state + m.gradient_shards),
    }


def measured_step_memory(jm, opt, model_name: str, x, y) -> dict:
    """One forward + backward of ``jm`` (its loss computed outside, as the tests' models need) with the gradients
    set to None first, under torch's profiler: the peak above the start (lost frees put back, and as recorded),
    what lives through it (the shards, AdamW's state), and explain()'s prediction of the step's peak."""
    opt.zero_grad(set_to_none=True)
    allocations = allocated_during(lambda: models.loss_fn(model_name, jm(x), y).backward())
    state = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    return {
        "measured_step_peak": allocations.peak_bytes,
        "recorded_step_peak": allocations.recorded_peak_bytes,
        "predicted_step_peak": explain(jm).memory.step.peak_bytes,
        "shard_bytes": sum(p.numel() * p.element_size() for p in jm.parameters()),
        "optimizer_state_bytes": sum(t.numel() * t.element_size() for t in state),
    }


def float16_reduce_near_its_range(model_name: str, strategy: str, largest: float = 48_000.0):
    """``parity`` in float16 (parameters, compute and reduce) with every rank on the same slice and the loss scaled
    so that the largest gradient element of a rank is about ``largest`` (read off a float32 backward of the first
    step): two ranks' sum of it would overflow float16 unless each is divided by the ranks first."""
    world_size = dist.get_world_size()
    x, y = models.batch(model_name, 2 * world_size, 0)
    reference = models.build(model_name)
    loss = models.loss_fn(model_name, reference(x[:2]), y[:2])
    grads = torch.autograd.grad(loss, [p for p in reference.parameters() if p.requires_grad])
    scale = largest / max(float(g.abs().max()) for g in grads)
    precision = MixedPrecision(torch.float16, reduce_dtype=torch.float16, output_dtype=torch.float32)
    return parity(model_name, strategy, steps=2, compute_dtype=torch.float16, reduce_dtype=torch.float16,
                  loss_scale=scale, same_batch_on_every_rank=True, mixed_precision=precision)


def expected_shard_numel(full_shapes, shard_ranks: int) -> int:
    """What each rank must hold of parameters of ``full_shapes`` sharded over ``shard_ranks`` ranks, written out
    here rather than read off the pass's layout: dim 0 cut into ``ceil(rows / N)`` rows per rank (padding rows
    included), a 0-d parameter as one row."""
    total = 0
    for shape in full_shapes:
        rows = shape[0] if shape else 1
        row_numel = 1
        for n in shape[1:]:
            row_numel *= n
        total += -(-rows // shard_ranks) * row_numel
    return total


def state_dict_round_trip(model_name: str, strategy: str):
    """full state dict -> load into a fresh sharded model -> full state dict: exact; and outputs match."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    source = models.build(model_name, seed=1)
    jm = thunder.jit(copy.deepcopy(source), transforms=[FSDP(strategy)], executors=executors_for("cpu"))
    saved = full_state_dict(jm)
    exact_save = all(torch.equal(saved[k], v) for k, v in source.state_dict().items())
    same_keys = sorted(saved) == sorted(source.state_dict())

    target = thunder.jit(models.build(model_name, seed=2), transforms=[FSDP(strategy)], executors=executors_for("cpu"))
    opt = torch.optim.AdamW(target.parameters(), lr=1e-3)
    load_full_state_dict(target, saved)
    again = full_state_dict(target)
    exact_round_trip = all(torch.equal(again[k], saved[k]) for k in saved)
    x, _ = models.batch(model_name, 2 * world_size, 0)
    x = _local(x, rank, world_size)
    out_err = _rel(target(x).detach(), source(x).detach())
    params_still_in_optimizer = all(
        p is q for p, q in zip(opt.param_groups[0]["params"], target.parameters())
    )
    # the module's own methods: load_state_dict takes full tensors (or DTensors), original_state_dict gathers
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    target.load_state_dict(source.state_dict())
    original = target.original_state_dict()
    module_methods_exact = sorted(original) == sorted(saved) and all(torch.equal(original[k], saved[k]) for k in saved)
    return {
        "exact_save": exact_save,
        "same_keys": same_keys,
        "exact_round_trip": exact_round_trip,
        "out_rel_err": out_err,
        "params_still_in_optimizer": params_still_in_optimizer,
        "module_methods_exact": module_methods_exact,
    }


def broadcast_from_rank0():
    """Ranks start from different weights; broadcast_from=0 makes every rank hold rank 0's."""
    rank = dist.get_rank()
    model = models.build("mlp", seed=100 + rank)
    rank0_model = models.build("mlp", seed=100)
    jm = thunder.jit(model, transforms=[FSDP("zero3", broadcast_from=0)], executors=executors_for("cpu"))
    full = full_state_dict(jm)
    return all(torch.equal(full[k], v) for k, v in rank0_model.state_dict().items())


def meta_device_init(strategy: str, broadcast_from=None):
    """A model built on the meta device is materialized (reset_parameters) and trains. Every rank seeds as the
    README asks (the same seed; with ``broadcast_from`` each its own, rank ``broadcast_from``'s weights wanted):
    every shard must be cut from one tensor, the one a CPU build with that seed holds."""
    rank = dist.get_rank()
    seed = 100 + (rank if broadcast_from is not None else 0)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = models.MLP()
    jm = thunder.jit(model, transforms=[FSDP(strategy, broadcast_from=broadcast_from)], executors=executors_for("cpu"))
    source = models.build("mlp", seed=100 + (broadcast_from or 0))  # the weights every rank must start from
    fsdp = fsdp_of(jm)
    shards_cut_from_source = all(
        torch.equal(jm.get_parameter(s.name).detach(), shard_tensor(source.get_parameter(s.name).detach(), s.layout, rank))
        for s in fsdp.sharding.owners()
    )
    full = full_state_dict(jm)
    gathered_is_source = all(torch.equal(full[k], v) for k, v in source.state_dict().items())
    x, y = models.batch("mlp", 2, 0)
    loss = models.loss_fn("mlp", jm(x), y)
    loss.backward()
    return {
        "devices": sorted({str(p.device) for p in jm.parameters()}),
        "finite": bool(torch.isfinite(loss)),
        "grads": all(p.grad is not None for p in jm.parameters()),
        "shards_cut_from_one_tensor": shards_cut_from_source,
        "gathered_is_that_tensor": gathered_is_source,
        "loss_as_that_model": _rel(loss.detach(), models.loss_fn("mlp", source(x), y).detach()) < 1e-6,
    }


def no_parameters():
    class Parameterless(torch.nn.Module):
        def forward(self, x):
            return torch.tanh(x) * 2

    jm = thunder.jit(Parameterless(), transforms=[FSDP("zero3")], executors=executors_for("cpu"))
    x = torch.randn(3, 4, requires_grad=True)
    out = jm(x)
    out.sum().backward()
    return bool(torch.allclose(out, torch.tanh(x) * 2)) and x.grad is not None


def layout_of(shape, world_size):
    return ShardLayout(tuple(shape), world_size)


def accumulation_parity(model_name: str, strategy: str, micro_batches: int = 3, cycles: int = 2, **fsdp_kwargs):
    """``no_sync`` gradient accumulation against one big batch in one process.

    Each cycle: ``micro_batches - 1`` forward+backward under ``no_sync`` (no reduce-scatter), then one outside
    it (one reduce-scatter per unit, of the sum), then an optimizer step. The reference takes the cycle's
    whole global batch at once. Reports gradient errors, the collectives of each micro-batch and the bytes
    the accumulators held.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    reference, jm, fsdp = _reference_and_fsdp_model(model_name, strategy, **fsdp_kwargs)
    opt = torch.optim.SGD(jm.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1)
    ref_params = dict(reference.named_parameters())
    per_micro = 2
    grad_err, reduce_scatters, accumulated_bytes = [], [], []
    for cycle in range(cycles):
        x, y = models.batch(model_name, per_micro * micro_batches * world_size, cycle)
        ref_opt.zero_grad()
        models.loss_fn(model_name, reference(x), y).backward()

        opt.zero_grad()
        # rank r's micro-batch k: rows [(k * N + r) * per_micro, ...): the ranks together cover the batch
        for k in range(micro_batches):
            rows = slice((k * world_size + rank) * per_micro, (k * world_size + rank + 1) * per_micro)
            last = k == micro_batches - 1
            with CollectiveBytes() as sent, contextlib.nullcontext() if last else no_sync(jm):
                loss = models.loss_fn(model_name, jm(x[rows]), y[rows]) / micro_batches
                loss.backward()
            reduce_scatters.append(sum(1 for kind, _ in sent.calls if kind is REDUCE_SCATTER))
            if k == micro_batches - 2:
                accumulated_bytes.append(fsdp.accumulators.pending_bytes())
        err = 0.0
        for spec in fsdp.sharding.owners():
            if spec.requires_grad:
                full = gather_full(jm.get_parameter(spec.name).grad, spec.layout, fsdp.group)
                err = _worst([err, _rel(full, ref_params[spec.name].grad)])
        grad_err.append(err)
        opt.step()
        ref_opt.step()
    # a plain step afterwards: the reduce-every-step variant, compiled now
    loss = models.loss_fn(model_name, jm(x[:per_micro]), y[:per_micro])
    loss.backward()
    return {
        "grad_rel_err": _worst(grad_err),
        "reduce_scatters_per_micro_batch": reduce_scatters,
        "units_with_grads": sum(
            1 for u in fsdp.unit_plan.units if any(fsdp.sharding.param(p).requires_grad for p in u.params)
        ),
        "accumulated_bytes": accumulated_bytes,
        "predicted_accumulator_bytes": explain(jm).memory.accumulator_bytes,
        "left_pending": fsdp.accumulators.pending_bytes(),
        "compiles": thunder.cache_misses(jm),
    }
