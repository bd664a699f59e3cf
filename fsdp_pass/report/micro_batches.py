"""Gradient accumulation on real ranks, micro-batch by micro-batch: what each one gathers and reduce-scatters,
unit by unit, what the ``no_sync`` accumulators hold, and the gradient shards it ends with. The knobs notebook
reads them.

:func:`accumulate_micro_batches` runs on every rank of the default group
(``run_on_local_ranks(accumulate_micro_batches, 2, config)`` spawns two gloo ranks): each builds the zoo's
Llama-style model from the same seed, jits it with ``FSDP``, and runs ``micro_batches`` forwards and backwards on
its rows of one global batch, all but the last inside ``no_sync``; it counts the collectives each one issues
(:class:`~fsdp_pass.report.measure.CollectiveBytes`) and reads, off the compile that micro-batch ran
(:func:`~fsdp_pass.api.explain`), which unit each gather and reduce-scatter belongs to.
:func:`reference_accumulation` computes the same gradients in one process without FSDP, to hold the ranks' shards
against (put back together by :func:`~fsdp_pass.report.rank_views.full_parameters`).
"""

from __future__ import annotations

from dataclasses import dataclass

import thunder
import torch
import torch.distributed as dist
from fsdp_pass_executors import executors_for

from fsdp_pass.api import explain, no_sync
from fsdp_pass.errors import FSDPError
from fsdp_pass.models import zoo
from fsdp_pass.op_names import CollectiveKind
from fsdp_pass.plan.units import UnitPlan
from fsdp_pass.report.measure import CollectiveBytes
from fsdp_pass.transform import FSDP


@dataclass(frozen=True)
class MicroBatch:
    synchronized: bool  # the last one, after the no_sync block; the others ran inside it
    gathers: int  # all-gathers issued on this rank, counted as they ran
    gathered_bytes: int  # their full buffers' bytes
    reduce_scatters: int
    by_unit: dict[str, tuple[int, int, int]]  # unit -> (forward gathers, backward gathers, reduce-scatters) of its compile
    accumulator_bytes: int  # what the no_sync accumulators hold after it


@dataclass(frozen=True)
class RankMicroBatches:
    rank: int
    micro_batches: list[MicroBatch]
    early_step_error: str  # what optimizer.step() raised after the first micro-batch, inside the no_sync block
    no_sync_note: str  # explain()'s note on the accumulators, of the synchronized micro-batch's compile
    grads: dict[str, torch.Tensor]  # parameter -> this rank's gradient shard after the synchronized micro-batch
    plan: UnitPlan  # the units of its compile, with every parameter's shard layout


def global_tokens(config: dict, world_size: int, micro_batches: int) -> torch.Tensor:
    """One row of ``seq + 1`` tokens per rank and micro-batch; micro-batch ``k`` of rank ``r`` is row
    ``k * world_size + r``."""
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, config["vocab"], (micro_batches * world_size, config["seq"] + 1), generator=generator)


def _model(config: dict, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return zoo.build("tiny", "cpu", **config)[0]


def _collectives_by_unit(jm) -> dict[str, tuple[int, int, int]]:
    return {u.name: (len(u.forward_gathers), len(u.backward_gathers), len(u.reduce_scatters))
            for u in explain(jm).units}


def _one_micro_batch(jm, fsdp: FSDP, x, y, scale: float, synchronized: bool) -> MicroBatch:
    with CollectiveBytes() as sent:
        if synchronized:
            (jm(x, y) * scale).backward()
        else:
            with no_sync(jm):
                (jm(x, y) * scale).backward()
    gathers = [size for kind, size in sent.calls if kind == CollectiveKind.ALL_GATHER]
    scatters = sum(1 for kind, _ in sent.calls if kind == CollectiveKind.REDUCE_SCATTER)
    return MicroBatch(synchronized, len(gathers), sum(gathers), scatters, _collectives_by_unit(jm),
                      fsdp.accumulators.pending_bytes())


def accumulate_micro_batches(config: dict, micro_batches: int = 3, seed: int = 0, units="blocks") -> RankMicroBatches:
    """``micro_batches`` forwards and backwards of the zoo's ``tiny`` model (``config`` overrides its fields) under
    ``FSDP("zero3", units=units)`` on this rank, on its rows of :func:`global_tokens`, all but the last inside
    ``no_sync``; each loss scaled by ``1 / micro_batches``. No optimizer step is taken (one is tried, wrongly,
    inside the block: the error it raises is kept)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    fsdp = FSDP("zero3", units=units)
    jm = thunder.jit(_model(config, seed), transforms=[fsdp], executors=executors_for("cpu"))
    opt = torch.optim.SGD(jm.parameters(), lr=0.1)
    tokens = global_tokens(config, world, micro_batches)
    done, early_step_error = [], ""
    for k in range(micro_batches):
        row = tokens[k * world + rank : k * world + rank + 1]
        done.append(_one_micro_batch(jm, fsdp, row[:, :-1], row[:, 1:], 1 / micro_batches, k == micro_batches - 1))
        if k == 0:
            try:
                opt.step()  # a mistake: the accumulated gradients have not reached the shards yet
            except FSDPError as e:
                early_step_error = str(e)
    note = next(n for n in explain(jm).notes if n.startswith("no_sync accumulators"))
    grads = {n: p.grad.detach().clone() for n, p in jm.named_parameters()}
    return RankMicroBatches(rank, done, early_step_error, note, grads, fsdp.unit_plan)


def reference_accumulation(config: dict, world_size: int, micro_batches: int = 3, seed: int = 0) -> dict:
    """One process, no FSDP: the gradients of every rank's micro-batches, each loss scaled by
    ``1 / (micro_batches * world_size)`` (the ranks' mean of their sums), by parameter name."""
    module = _model(config, seed)
    for row in global_tokens(config, world_size, micro_batches).split(1):
        (module(row[:, :-1], row[:, 1:]) / (micro_batches * world_size)).backward()
    return {n: p.grad.detach().clone() for n, p in module.named_parameters()}
