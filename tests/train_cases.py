"""The training loop around the step, run on every rank of a gloo RankPool: clipping and gradient norms
against a single-process reference (module-level functions, so spawned ranks can import them)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import fsdp_pass
from fsdp_pass import FSDPError, no_sync
from fsdp_pass.shard.global_view import gather_full
from tests import models
from tests.rank_cases import _local, _norm_rel, _reference_and_fsdp_model


def _full_grads(jm, fsdp) -> dict[str, torch.Tensor]:
    """Every trainable parameter's whole gradient (collective), by its first name."""
    return {
        s.name: gather_full(jm.get_parameter(s.name).grad, s.layout, fsdp.group)
        for s in fsdp.sharding.owners()
        if s.requires_grad and jm.get_parameter(s.name).grad is not None
    }


def _step(jm, model_name, x, y, rank, world_size):
    loss = models.loss_fn(model_name, jm(_local(x, rank, world_size)), _local(y, rank, world_size))
    loss.backward()
    return loss


def clip_parity(model_name: str, strategy: str, norm_type: float = 2.0, steps: int = 3, **fsdp_kwargs):
    """SGD with momentum, gradients clipped by the global norm each step, against one process doing the same
    with torch.nn.utils.clip_grad_norm_. Returns the worst relative errors and what each rank saw."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    reference, jm, fsdp = _reference_and_fsdp_model(model_name, strategy, **fsdp_kwargs)
    trainable = dict((n, p) for n, p in reference.named_parameters() if p.requires_grad)
    opt = torch.optim.SGD(jm.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(list(trainable.values()), lr=0.1, momentum=0.9)
    max_norm = None
    out = {"total_rel_err": [], "clipped_grad_rel_err": [], "param_norm_rel_err": [], "totals": [], "coefs": []}
    for step in range(steps):
        x, y = models.batch(model_name, 2 * world_size, step)
        ref_opt.zero_grad()
        models.loss_fn(model_name, reference(x), y).backward()
        opt.zero_grad()
        _step(jm, model_name, x, y, rank, world_size)

        norms = fsdp_pass.grad_norms(jm, norm_type)  # before clipping: each parameter against the reference
        for unit, name, norm in norms.params:
            ref = float(torch.linalg.vector_norm(trainable[name].grad.double(), norm_type))
            out["param_norm_rel_err"].append(abs(norm - ref) / max(ref, 1e-30))
        if max_norm is None:  # clipping bites from the first step on
            max_norm = 0.3 * float(torch.nn.utils.get_total_norm([p.grad for p in trainable.values()], norm_type))
        ref_total = torch.nn.utils.clip_grad_norm_(list(trainable.values()), max_norm, norm_type)
        total = fsdp_pass.clip_grad_norm_(jm, max_norm, norm_type)
        out["totals"].append(float(total))
        out["coefs"].append(min(1.0, max_norm / (float(total) + 1e-6)))
        out["total_rel_err"].append(abs(float(total) - float(ref_total)) / float(ref_total))
        assert abs(norms.total - float(total)) <= 1e-6 * float(total), (norms.total, float(total))
        full = _full_grads(jm, fsdp)
        out["clipped_grad_rel_err"].append(_norm_rel(list(full.values()), [trainable[n].grad for n in full]))
        opt.step()
        ref_opt.step()
    full_params = fsdp_pass.full_state_dict(jm)
    out["param_rel_err"] = _norm_rel([full_params[n] for n in trainable], list(trainable.values()))
    out["table"] = str(norms)
    out["units"] = sorted(norms.units())
    return out


def clip_matches_own_full_grads(model_name: str, strategy: str, norm_type: float = 2.0, **fsdp_kwargs):
    """Where the reference's arithmetic differs (mixed precision, offload): the norm clip_grad_norm_ returns
    against torch's norm of this model's own gradients gathered whole in one process; and the clipped
    gradients against those gradients scaled by torch's rule."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    _, jm, fsdp = _reference_and_fsdp_model(model_name, strategy, **fsdp_kwargs)
    x, y = models.batch(model_name, 2 * world_size, 0)
    _step(jm, model_name, x, y, rank, world_size)
    whole = {n: g.clone() for n, g in _full_grads(jm, fsdp).items()}
    expected = torch.nn.utils.get_total_norm(list(whole.values()), norm_type)
    max_norm = 0.5 * float(expected)
    total = fsdp_pass.clip_grad_norm_(jm, max_norm, norm_type)
    scaled = [g * min(1.0, max_norm / (float(expected) + 1e-6)) for g in whole.values()]
    return {
        "total_rel_err": abs(float(total) - float(expected)) / float(expected),
        "clipped_grad_rel_err": _norm_rel(list(_full_grads(jm, fsdp).values()), scaled),
        "total_device": str(total.device),
        "grad_devices": sorted({str(p.grad.device) for p in jm.parameters() if p.grad is not None}),
    }


def nonfinite_and_misuse(model_name: str, strategy: str, poisoned_rank: int = 1):
    """A NaN in one rank's shard of one gradient: every rank's table names its unit and parameter, and
    clip_grad_norm_(error_if_nonfinite=True) raises an FSDPError naming it on every rank. Then the misuse
    errors: a norm asked for while no_sync() gradients are pending, and a norm_type that is not a norm."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    _, jm, fsdp = _reference_and_fsdp_model(model_name, strategy)
    x, y = models.batch(model_name, 2 * world_size, 0)
    _step(jm, model_name, x, y, rank, world_size)
    victim = [s for s in fsdp.sharding.owners() if s.requires_grad][-1]
    if rank == poisoned_rank:
        jm.get_parameter(victim.name).grad.view(-1)[0] = math.nan
    unit_of = {name: u.name for u in fsdp.unit_plan.units for name in u.params}
    out = {"victim": victim.name, "victim_unit": unit_of[victim.name], "errors": {}}
    out["nonfinite"] = fsdp_pass.grad_norms(jm).nonfinite()
    out["nonfinite_inf_norm"] = fsdp_pass.grad_norms(jm, math.inf).nonfinite()
    out["table"] = str(fsdp_pass.grad_norms(jm))
    for label, call in (
        ("nonfinite", lambda: fsdp_pass.clip_grad_norm_(jm, 1.0, error_if_nonfinite=True)),
        ("norm_type", lambda: fsdp_pass.clip_grad_norm_(jm, 1.0, norm_type=-1)),
    ):
        try:
            call()
        except FSDPError as e:
            out["errors"][label] = str(e)
    out["total_without_error"] = float(fsdp_pass.clip_grad_norm_(jm, 1.0))  # NaN, as torch returns
    for p in jm.parameters():
        p.grad = None  # the next backward must not add onto the NaN
    with no_sync(jm):
        _step(jm, model_name, x, y, rank, world_size)
    try:
        fsdp_pass.clip_grad_norm_(jm, 1.0)
    except FSDPError as e:
        out["errors"]["no_sync"] = str(e)
    _step(jm, model_name, x, y, rank, world_size)  # the flush: the accumulated sum is reduce-scattered
    out["after_flush_finite"] = math.isfinite(float(fsdp_pass.clip_grad_norm_(jm, 1.0)))
    return out
