"""The gradient norm of a sharded model, clipping by it, and where a NaN or inf came from.

``clip_grad_norm_(jm, max_norm, norm_type=2.0, error_if_nonfinite=False) -> total norm`` (a 0-d tensor)
``grad_norms(jm, norm_type=2.0) -> GradNorms`` (the total, per unit and per parameter; prints one short line per
unit: its norm, how many of its parameters' gradients are not finite, its largest parameter)

Both are collective: every rank of the FSDP group calls them, after the synchronized backward.
``torch.nn.utils.clip_grad_norm_(jm.parameters())`` computes each rank's norm of its own shards: a
different number on each rank, and not the model's norm.

1. Each rank reduces its gradient shards to one float64 number per parameter: the sum of ``|g|^p``
   (the largest ``|g|`` for ``norm_type=inf``). Padding rows hold zero gradients and add nothing; a tied
   parameter is one shard and counts once; frozen parameters and parameters without a gradient count
   zero. Offloaded gradients are reduced where they live.
2. One all-reduce of that vector over the FSDP group (SUM; MAX for inf, with a NaN flag per parameter, since
   a MAX does not carry NaN reliably) gives every rank every parameter's norm.
3. The total norm is worked out from the vector on every rank alike; clipping scales the gradient shards
   in place by ``min(1, max_norm / (total + 1e-6))`` (:func:`torch.nn.utils.clip_grads_with_norm_`, the rule
   of ``torch.nn.utils.clip_grad_norm_``); with ``error_if_nonfinite=True`` a non-finite total is an
   FSDPError naming the units it comes from, with counts. Where in the step it first appeared, and on which
   rank: ``FSDP(..., check_finite=True)`` (:mod:`fsdp_pass.ops.finite_checks`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_pass.api import fsdp_of
from fsdp_pass.errors import check, fail
from fsdp_pass.text import format_table
from fsdp_pass.ranks import reduce_device

NOT_COMPILED = "(not compiled yet)"


@dataclass(frozen=True)
class GradNorms:
    """Gradient norms of the whole model, the same on every rank."""

    norm_type: float
    total: float
    params: tuple[tuple[str, str, float], ...]  # (unit, parameter, norm), in unit order

    def units(self) -> dict[str, float]:
        """Unit name -> the norm of its gradients taken together."""
        parts: dict[str, list[float]] = {}
        for unit, _, norm in self.params:
            parts.setdefault(unit, []).append(norm)
        return {unit: _combine(norms, self.norm_type) for unit, norms in parts.items()}

    def nonfinite(self) -> list[tuple[str, str]]:
        """(unit, parameter) of every gradient with a NaN or an inf in it."""
        return [(unit, name) for unit, name, norm in self.params if not math.isfinite(norm)]

    def nonfinite_units(self) -> list[tuple[str, int, int]]:
        """(unit, parameters with a NaN or an inf in their gradient, trainable parameters), per unit that has one,
        in unit order."""
        counts: dict[str, list[int]] = {}
        for unit, _, norm in self.params:
            bad_and_all = counts.setdefault(unit, [0, 0])
            bad_and_all[0] += not math.isfinite(norm)
            bad_and_all[1] += 1
        return [(unit, bad, total) for unit, (bad, total) in counts.items() if bad]

    def __str__(self) -> str:
        """One line per unit: its norm, its trainable parameters, how many of their gradients are not finite, and
        its largest parameter's norm (named inside the unit)."""
        rows = []
        for unit, norm in self.units().items():
            mine = [(n, v) for u, n, v in self.params if u == unit]
            bad = sum(not math.isfinite(v) for _, v in mine)
            name, largest = max(mine, key=lambda nv: nv[1] if math.isfinite(nv[1]) else math.inf)
            short = name.removeprefix(unit + ".") if unit != NOT_COMPILED else name
            rows.append((unit, f"{norm:.6g}", str(len(mine)), str(bad) if bad else "-", f"{short} ({largest:.4g})"))
        head = f"gradient norms (norm_type={self.norm_type:g}): total {self.total:.6g}"
        return "\n".join([head, *format_table(("unit", "norm", "params", "non-finite", "largest"), rows)])


def _combine(norms: list[float], p: float) -> float:
    if any(math.isnan(n) for n in norms):  # Python's max() would skip a NaN or not, by its position
        return math.nan
    if p == math.inf:
        return max(norms, default=0.0)
    return sum(n**p for n in norms) ** (1.0 / p)


def _check_norm_type(norm_type) -> float:
    p = float(norm_type)
    check(
        p == math.inf or p > 0,
        f"norm_type={norm_type!r}: the gradient norm is taken for a positive p or inf.",
        "Pass norm_type=2.0 (the default), another positive number, or float('inf').",
    )
    return p


def _local_part(grad: torch.Tensor | None, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's part of one parameter's norm, whether it has a NaN), as float64 0-d tensors."""
    if grad is None or grad.numel() == 0:
        zero = torch.zeros((), dtype=torch.float64)
        return zero, zero
    g = grad.detach()
    if p == math.inf:
        part = torch.linalg.vector_norm(g, math.inf, dtype=torch.float64)
        has_nan = part.isnan().to(torch.float64)
        return torch.nan_to_num(part, nan=math.inf), has_nan
    part = torch.linalg.vector_norm(g, p, dtype=torch.float64) ** p
    return part, torch.zeros((), dtype=torch.float64)


def _trainable(jm):
    """(FSDP transform, [(unit, name, shard parameter)] for each trainable parameter, counted once)."""
    fsdp = fsdp_of(jm)
    check(
        not fsdp.accumulators.pending,
        lambda: f"The gradient norm was asked for while {len(fsdp.accumulators.pending)} unit(s) hold gradients "
        "accumulated under no_sync(): the parameters have no synchronized gradient yet.",
        "Take the norm (and clip) after the last micro-batch's backward, the one run outside no_sync().",
    )
    unit_of = {}
    if fsdp.unit_plan is not None:
        owner = {s.name: s.shard_of for s in fsdp.sharding.params}
        unit_of = {owner.get(name, name): u.name for u in fsdp.unit_plan.units for name in u.params}
    owners = [s for s in fsdp.sharding.owners() if s.requires_grad]
    return fsdp, [(unit_of.get(s.name, NOT_COMPILED), s.name, jm.get_parameter(s.name)) for s in owners]


def _norm_vector(jm, p: float):
    """(transform, entries, every parameter's norm^p (max for inf) over all ranks, as a float64 CPU tensor)."""
    fsdp, entries = _trainable(jm)
    device = reduce_device(fsdp.group, fsdp.model.device)
    parts = [t.to(device) for _, _, param in entries for t in _local_part(param.grad, p)]
    vector = torch.stack(parts) if parts else torch.zeros(0, dtype=torch.float64, device=device)
    dist.all_reduce(vector, op=dist.ReduceOp.MAX if p == math.inf else dist.ReduceOp.SUM, group=fsdp.group)
    vector = vector.cpu().view(-1, 2)
    values, nan_flags = vector[:, 0], vector[:, 1]
    return fsdp, entries, torch.where(nan_flags > 0, torch.full_like(values, math.nan), values)


def _measured(jm, norm_type):
    """(the transform, its trainable shard parameters, their :class:`GradNorms`): one all-reduce."""
    p = _check_norm_type(norm_type)
    fsdp, entries, values = _norm_vector(jm, p)
    norms = values if p == math.inf else values ** (1.0 / p)
    params = tuple((unit, name, float(n)) for (unit, name, _), n in zip(entries, norms))
    return fsdp, [param for _, _, param in entries], GradNorms(p, _combine([n for _, _, n in params], p), params)


def grad_norms(jm, norm_type: float = 2.0) -> GradNorms:
    """Every trainable parameter's gradient norm, per unit and in total, the same on every rank (collective)."""
    return _measured(jm, norm_type)[2]


def nonfinite_summary(norms: GradNorms, most: int = 4) -> str:
    """The units whose gradients are not finite, with counts (the first ``most`` of them named)."""
    units = norms.nonfinite_units()
    named = ", ".join(f"{unit!r} ({bad} of its {total} parameters)" for unit, bad, total in units[:most])
    more = f" and {len(units) - most} more" if len(units) > most else ""
    if not units:
        return (f"The total gradient norm (norm_type={norms.norm_type:g}) is {norms.total}, though every parameter's "
                "norm is finite: their sum overflows.")
    return (
        f"The total gradient norm (norm_type={norms.norm_type:g}) is {norms.total}: non-finite gradients in "
        f"{len(units)} of {len(norms.units())} units: {named}{more}."
    )


def clip_grad_norm_(jm, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients of a model jitted with ``FSDP`` by their norm over the whole model; returns that norm.

    The counterpart of ``torch.nn.utils.clip_grad_norm_`` (same arguments, same rule) for a sharded model:
    the norm is the whole model's, the same on every rank. Collective: every rank calls it.
    """
    fsdp, params, norms = _measured(jm, norm_type)
    if error_if_nonfinite and not math.isfinite(norms.total):
        fail(nonfinite_summary(norms), (
            "Find where they come from: FSDP(..., check_finite=True) names the first parameter or output and rank "
            "that made a NaN or an inf in the step, print(fsdp_pass.grad_norms(model)) shows each unit's norm "
            "(lower the learning rate, check the inputs, use a loss scaler with float16), or pass "
            "error_if_nonfinite=False to scale them anyway."
        ))
    with_grads = [param for param in params if param.grad is not None]
    first = with_grads[0].grad if with_grads else None
    total = torch.tensor(norms.total, dtype=first.dtype if first is not None else torch.float32,
                         device=first.device if first is not None else fsdp.model.device or torch.device("cpu"))
    if with_grads:
        torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, total)
    return total
