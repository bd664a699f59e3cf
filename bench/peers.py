"""The systems the benchmark compares, as data: each builds a :class:`Trainer` from a fresh model.

A builder takes the freshly built model (same seed on every rank, so every rank starts from the same
weights) and returns a :class:`Trainer` whose ``.step(idx, targets)`` runs forward, loss, backward,
``AdamW(lr=1e-3).step()`` and ``zero_grad()``, and returns the loss as a float.

Systems:
  eager          plain module, no communication (each rank trains alone: a reference row)
  thunder        plain ``thunder.jit`` of the module, no communication (Thunder's own cost, no FSDP)
  ddp            torch DistributedDataParallel on CPU
  fsdp2          torch ``fully_shard`` on every decoder layer, then the root (default: reshard after
                 forward, i.e. ZeRO-3-like); ``fsdp2 zero2`` keeps them gathered
                 (``reshard_after_forward=False``)
  thunder_fsdp   Thunder 0.2.6's own FSDP transform (``thunder.distributed.transforms.fsdp_v2``)
  ours           ``fsdp_pass.FSDP(strategy, units=..., schedule=...)``; configurations in :data:`OURS_CONFIGS`

To add a column to the table, give a system an ``extra_stats(trainer) -> dict``: its keys become
columns (``peak unsharded MB`` is always shown; "—" where no hook fills it). Thunder-based trainers
expose ``trainer.module`` (the ThunderModule: ``thunder.last_traces(trainer.module)``,
``thunder.last_backward_traces(trainer.module)``) and ``trainer.transform`` (the FSDP transform).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fsdp_pass_executors import executors_for

from bench.model import loss_fn
from fsdp_pass import FSDP, BySize, Schedule, no_sync
from fsdp_pass.errors import FSDPError
from fsdp_pass.op_names import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from fsdp_pass.plan.mixed_precision import MixedPrecision
from fsdp_pass.report.step_stats import step_stats

LR = 1e-3

# Columns filled by ``System.extra_stats``; always printed, "—" where a system has no value.
EXTRA_COLUMNS = ("units", "peak unsharded MB", "model ms", "model step peak MB", "step peak MB")

BF16 = MixedPrecision(torch.bfloat16, output_dtype=torch.float32)
BF16_REDUCE = MixedPrecision(torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=torch.float32)
# (row name, strategy, units policy, prefetch, executors[, FSDP options[, Trainer options]]) for fsdp_pass.FSDP. Add a line to benchmark
# another configuration. prefetch: the Schedule's depth, or None for no scheduling pass. executors:
# "ours" = fsdp_pass_executors.executors_for("cpu") (collectives on fsdp_comm), "thunder" = Thunder's
# torch executor alone (then Thunder's own sort_waits orders the collectives: every gather at the top).
OURS_CONFIGS = [
    ("ours zero2 per-param", "zero2", "per_parameter", 1, "ours"),
    ("ours zero2 blocks", "zero2", "blocks", 1, "ours"),
    ("ours zero2 blocks unscheduled", "zero2", "blocks", None, "ours"),
    ("ours zero3 blocks", "zero3", "blocks", 1, "ours"),
    ("ours zero3 default", "zero3", None, 1, "ours"),  # units= left out: the step model chooses (cpu-gloo)
    ("ours zero2 default", "zero2", None, 1, "ours"),
    ("ours zero3 by-size 0.5MB", "zero3", "by_size:500000", 1, "ours"),
    ("ours zero3 by-size whole", "zero3", "by_size:1000000000", 1, "ours"),  # the whole model one unit
    ("ours zero3 blocks prefetch 2", "zero3", "blocks", 2, "ours"),
    ("ours zero3 blocks unscheduled", "zero3", "blocks", None, "ours"),
    ("ours zero3 blocks thunder order", "zero3", "blocks", None, "thunder"),
    ("ours zero3 by-size 1.7MB", "zero3", "by_size:1700000", 1, "ours"),  # two decoder layers per unit
    ("ours zero2 by-size 1.7MB", "zero2", "by_size:1700000", 1, "ours"),
    ("ours zero2 by-size whole", "zero2", "by_size:1000000000", 1, "ours"),  # the whole model one unit
    # the auto planner: this machine's cost inputs, or measured on the ranks at hand; no budget, then one between
    # the planner's predicted peaks of the blocks ZeRO-3 and ZeRO-2 plans (bench model, 4 layers, world 2: 21.6 and
    # 24.1 MiB, `python -m bench.plan_check`)
    ("ours auto", "auto", "blocks", 1, "ours", {"cost": "cpu-gloo"}),
    ("ours auto probed", "auto", "blocks", 1, "ours", {"cost": "probe"}),  # cost inputs measured on these ranks
    ("ours auto 22MiB", "auto", "blocks", 1, "ours", {"cost": "cpu-gloo", "memory_budget": "22MiB"}),
    ("ours zero3 blocks checkpointed", "zero3", "blocks", 1, "ours", {"checkpoint_activations": True}),
    ("ours zero3 blocks selective", "zero3", "blocks", 1, "ours", {"checkpoint_activations": "selective"}),
    # budgets that need checkpointing at 2 ranks (the smallest peak without is 20.6 MiB; with, 12.4 MiB)
    ("ours auto 16MiB", "auto", "blocks", 1, "ours", {"cost": "cpu-gloo", "memory_budget": "16MiB"}),
    ("ours auto 14MiB", "auto", "blocks", 1, "ours", {"cost": "cpu-gloo", "memory_budget": "14MiB"}),
    ("ours zero3 blocks bf16", "zero3", "blocks", 1, "ours", {"mixed_precision": BF16}),
    ("ours zero3 blocks bf16 reduce bf16", "zero3", "blocks", 1, "ours", {"mixed_precision": BF16_REDUCE}),
    ("ours zero3 blocks offloaded", "zero3", "blocks", 1, "ours", {"offload_to": "cpu"}),
    ("ours zero3 blocks 4 micro-batches", "zero3", "blocks", 1, "ours", {}, {"micro_batches": 4}),
    ("ours zero3 blocks 4 micro no_sync", "zero3", "blocks", 1, "ours", {}, {"micro_batches": 4, "no_sync": True}),
]
OURS_NOTES = {
    "ours zero3 blocks unscheduled": "unscheduled: no scheduling pass; each gather is issued right before its wait "
    "(nothing overlaps it)",
    "ours zero3 blocks offloaded": "offloaded: shards, gradients, optimizer state on the CPU; on this CPU-only host "
    "the copies to and from the 'device' are same-device copies (their cost, not a PCIe transfer's)",
    "ours zero3 blocks 4 micro-batches": "4 micro-batches: each step runs forward+backward 4 times before the optimizer "
    "(4x the compute of the other rows); the no_sync row reduce-scatters only on the last",
    "ours zero3 blocks thunder order": "thunder order: no scheduling pass, Thunder's torch executor, whose sort_waits "
    "issues every gather at the top of the forward/backward (all overlap, the whole model gathered at once)",
}

# (row name, FSDPType name, FSDPBucketingStrategy name) for Thunder's own FSDP.
# Not listed: bucketing_strategy=BLOCK/LAYER. In lightning-thunder 0.2.6 nothing reads it (the
# FSDPCommBucketing pass is not applied by the fsdp_v2 transform), so it issues the same 39 AG + 39 RS.
THUNDER_FSDP_CONFIGS = [
    ("thunder_fsdp zero2", "ZERO2", "NONE"),
    ("thunder_fsdp zero3", "ZERO3", "NONE"),
]
THUNDER_ZERO3_NOTE = (
    "thunder_fsdp zero3: in lightning-thunder 0.2.6 FSDPType only reaches the TransformerEngine executor; "
    "the traces (and collectives) are those of zero2"
)


class Trainer:
    """One system's training step on this rank.

    ``micro_batches`` K > 1: each step runs K forward+backward passes over the batch (loss / K each) before the
    optimizer step, as gradient accumulation does; ``no_sync``: the first K - 1 of them under
    ``fsdp_pass.no_sync`` (no reduce-scatter), else every one reduce-scatters.
    """

    def __init__(self, module: nn.Module, *, transform=None, parameters=None, micro_batches=1, no_sync=False):
        self.module = module  # what is called: the wrapped module / ThunderModule
        self.transform = transform  # the FSDP transform object, for Thunder-based systems
        params = list(parameters if parameters is not None else module.parameters())
        self.optimizer = torch.optim.AdamW(params, lr=LR)
        self.micro_batches, self.no_sync = micro_batches, no_sync

    def step(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
        for k in range(self.micro_batches):
            accumulate = self.no_sync and k < self.micro_batches - 1
            with no_sync(self.module) if accumulate else contextlib.nullcontext():
                loss = loss_fn(self.module(idx), targets)
                (loss / self.micro_batches).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


@dataclass(frozen=True)
class System:
    name: str
    build: Callable[[nn.Module], Trainer]
    sharding: str  # "none", "replicated", "zero2", "zero3": what the row is (not used for the floor)
    extra_stats: Callable[[Trainer], dict] | None = None
    note: str | None = None  # printed under the table
    replicas: int = 1  # HSDP: copies of the model (gathers and reduce-scatters in groups of world / replicas)

    def group_sizes(self, world: int) -> dict:
        """Kind -> ranks of the group it runs on, where that is not the world (HSDP)."""
        if self.replicas == 1:
            return {}
        shard = world // self.replicas
        return {ALL_GATHER: shard, REDUCE_SCATTER: shard, ALL_REDUCE: self.replicas}


def thunder_executors(which: str = "ours"):
    """``"ours"``: the project's executors for CPU; ``"thunder"``: Thunder's own (its torch executor)."""
    from thunder.extend import get_executor

    return executors_for("cpu") if which == "ours" else [get_executor("torch")]


# ----------------------------------------------------------------------------------------- builders
def build_eager(model: nn.Module) -> Trainer:
    return Trainer(model)


def build_thunder(model: nn.Module) -> Trainer:
    import thunder

    jm = thunder.jit(model, executors=thunder_executors())
    return Trainer(jm)


def build_ddp(model: nn.Module) -> Trainer:
    from torch.nn.parallel import DistributedDataParallel

    return Trainer(DistributedDataParallel(model))


def _fsdp2(model: nn.Module, reshard_after_forward: bool) -> Trainer:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    # the root keeps fully_shard's default (its parameters stay gathered from the end of the forward
    # into the backward, which needs them first); passing True would gather them twice
    root_kwargs = {} if reshard_after_forward else {"reshard_after_forward": False}
    fully_shard(model, mesh=mesh, **root_kwargs)
    return Trainer(model)


HSDP_REPLICAS = 2


def hsdp_mesh():
    """(2 replicas) x (world / 2 ranks per shard group): HSDP's mesh on this machine's ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world % HSDP_REPLICAS or world < 2 * HSDP_REPLICAS:
        raise ValueError(f"HSDP rows need a world size that is a multiple of {HSDP_REPLICAS}, at least 4: --world 4")
    return init_device_mesh("cpu", (HSDP_REPLICAS, world // HSDP_REPLICAS), mesh_dim_names=("replicate", "shard"))


def build_fsdp2_hsdp(model: nn.Module) -> Trainer:
    from torch.distributed.fsdp import fully_shard

    mesh = hsdp_mesh()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return Trainer(model)


def build_ours_hsdp(model: nn.Module) -> Trainer:
    import thunder

    transform = FSDP("zero3", mesh=hsdp_mesh())
    jm = thunder.jit(model, transforms=[transform], executors=thunder_executors("ours"))
    return Trainer(jm, transform=transform)


def build_fsdp2(model: nn.Module) -> Trainer:
    return _fsdp2(model, reshard_after_forward=True)


def build_fsdp2_zero2(model: nn.Module) -> Trainer:
    return _fsdp2(model, reshard_after_forward=False)


def thunder_fsdp_builder(sharding: str, bucketing: str) -> Callable[[nn.Module], Trainer]:
    def build(model: nn.Module) -> Trainer:
        import thunder
        from thunder.distributed import FSDPBucketingStrategy, FSDPType
        from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

        transform = FSDPTransform(
            device=torch.device("cpu"),  # the default is cuda:LOCAL_RANK
            sharding_strategy=FSDPType[sharding],
            bucketing_strategy=FSDPBucketingStrategy[bucketing],
            release_original_parameters=True,
        )
        jm = thunder.jit(model, transforms=[transform], executors=thunder_executors("thunder"))
        return Trainer(jm, transform=transform)

    return build


def ours_builder(
    strategy: str,
    units: str | None,
    prefetch: int | None,
    executors: str,
    options: dict | None = None,
    trainer_options: dict | None = None,
) -> Callable[[nn.Module], Trainer]:
    """``options``: more keyword arguments of ``FSDP`` (e.g. ``checkpoint_activations``); ``trainer_options``:
    of :class:`Trainer` (``micro_batches``, ``no_sync``)."""

    def build(model: nn.Module) -> Trainer:
        import thunder

        policy = BySize(int(units.split(":")[1])) if units and units.startswith("by_size:") else units
        schedule = None if prefetch is None else Schedule(prefetch=prefetch)
        opts = dict(options or {})
        if opts.get("cost") == "probe":  # collective: the same fitted numbers on every rank, so the same plan
            from fsdp_pass.cost.probe import probe

            opts["cost"] = probe()
        if policy is not None:  # None: units= left out, the step model chooses them
            opts["units"] = policy
        transform = FSDP(strategy, schedule=schedule, **opts)
        jm = thunder.jit(model, transforms=[transform], executors=thunder_executors(executors))
        return Trainer(jm, transform=transform, **(trainer_options or {}))

    return build


def trace_stats(trainer: Trainer) -> dict:
    """Peak gathered-parameter memory read off the final traces (``fsdp_pass.report.step_stats``)."""
    import thunder

    fwd = thunder.last_traces(trainer.module)[-1]
    bwd = thunder.last_backward_traces(trainer.module)[-1]
    stats = step_stats(fwd, bwd, dist.get_world_size())
    return {"peak unsharded MB": f"{stats.peak_gathered_bytes / 1e6:.3f}"}


def ours_stats(trainer: Trainer) -> dict:
    """``trace_stats``, and the plan the row ran: its units (how many reshard after forward) and what the auto
    planner's step model predicts for it (``FSDP.predict_step``: an auto row with its own cost inputs, the others
    with the ``cpu-gloo`` defaults), the peak less what lives before the step, as ``step peak MB`` measures it; none
    for rows of several micro-batches per step."""
    transform = trainer.transform
    plan = transform.compiled_step.plan
    resharded = sum(u.reshard_after_forward for u in plan.units)
    levels = [u.checkpoint for u in plan.units if u.checkpointed]
    checkpointed = f", {levels.count('full')} full + {levels.count('selective')} selective ckpt" if levels else ""
    stats = trace_stats(trainer) | {"units": f"{len(plan.units)} ({resharded} resharded{checkpointed})"}
    if trainer.micro_batches > 1:  # the model prices one forward and backward per optimizer step
        return stats
    try:
        model = transform.predict_step()
    except FSDPError:  # units the model cannot price (per-parameter ones cut its pieces): no prediction
        return stats
    return stats | {"model ms": f"{model.step_s * 1e3:.1f}",
                    "model step peak MB": f"{(model.peak_bytes - model.persistent_bytes) / 1e6:.2f}"}


def full_model_stats(trainer: Trainer) -> dict:
    """DDP keeps every parameter unsharded all the time."""
    return {"peak unsharded MB": f"{sum(p.numel() * p.element_size() for p in trainer.module.parameters()) / 1e6:.3f}"}


def all_systems() -> list[System]:
    systems = [
        System("eager", build_eager, "none", note="eager: no communication, each rank trains alone on its own batches"),
        System(
            "thunder",
            build_thunder,
            "none",
            note="thunder: plain thunder.jit, no communication (what Thunder's execution costs without FSDP)",
        ),
        System("ddp", build_ddp, "replicated", extra_stats=full_model_stats),
        System(
            "fsdp2",
            build_fsdp2,
            "zero3",
            note="fsdp2: fully_shard on each decoder layer, then the root; default resharding (ZeRO-3-like, "
            "the root stays gathered into the backward)",
        ),
        System("fsdp2 zero2", build_fsdp2_zero2, "zero2", note="fsdp2 zero2: the same, reshard_after_forward=False"),
    ]
    for name, st, bucket in THUNDER_FSDP_CONFIGS:
        note = THUNDER_ZERO3_NOTE if st == "ZERO3" else None
        systems.append(System(name, thunder_fsdp_builder(st, bucket), st.lower(), extra_stats=trace_stats, note=note))
    systems += [
        System(name, ours_builder(*config), config[0], extra_stats=ours_stats, note=OURS_NOTES.get(name))
        for name, *config in OURS_CONFIGS
    ]
    hsdp = f"{HSDP_REPLICAS} replicas x world/{HSDP_REPLICAS} ranks per shard group; needs --world 4 or more"
    systems += [
        System("fsdp2 hsdp", build_fsdp2_hsdp, "zero3", replicas=HSDP_REPLICAS,
               note=f"fsdp2 hsdp: fully_shard on a 2-D mesh ({hsdp}); default resharding"),
        System("ours zero3 hsdp", build_ours_hsdp, "zero3", extra_stats=ours_stats, replicas=HSDP_REPLICAS,
               note=f"ours zero3 hsdp: FSDP('zero3', mesh=2-D mesh) ({hsdp}), blocks, prefetch 1"),
    ]
    return systems


def select(systems: list[System], only: str | None) -> list[System]:
    """``only``: comma list; a token picks the system of that name, or every system whose name
    starts with the token followed by a space (``ours`` picks all ``ours ...`` rows); ``=name`` picks that
    name alone (``=ours zero3 blocks``, not its variants)."""
    if not only:
        return systems
    tokens = [t.strip() for t in only.split(",") if t.strip()]

    def picks(name: str, token: str) -> bool:
        if token.startswith("="):
            return name == token[1:]
        return name == token or name.startswith(token + " ")

    picked = [s for s in systems if any(picks(s.name, t) for t in tokens)]
    unknown = [t for t in tokens if not any(picks(s.name, t) for s in systems)]
    if unknown:
        names = ", ".join(s.name for s in systems)
        raise SystemExit(f"--only: unknown system(s) {unknown}; known: {names}")
    return picked
