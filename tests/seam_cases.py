"""The seam matrix's cases (tests/test_seams.py): the features users combine, a pairwise-covering set of
combinations, and the rank function that trains one combination on gloo ranks against one process.

Factors (:data:`FACTORS`): the units (left out: the step model's default; ``"blocks"``; ``FSDP("auto")``), the
strategy (ZeRO-2, ZeRO-3, HSDP on a 2 x 1 mesh: 2 replicas of a shard group of one rank), the precision (float32;
bfloat16 with a float32 reduce; int8 gathers into bfloat16; float16 with ``fsdp_pass.GradScaler``), one feature
(``check_finite``, offload to the CPU, ``no_sync`` accumulation over two micro-batches, activation
checkpointing) and the per-rank sequence lengths (equal, or ragged: each rank its own).

:func:`all_pairs` builds the combinations: every value of every factor meets every value of every other factor
in at least one case (a pairwise covering), where :func:`allowed` lets them meet. ``FSDP("auto")`` plans the
resharding and the activation checkpointing itself (it starts from ZeRO-3 and raises when
``checkpoint_activations=`` is passed): with it, "zero3" means ``FSDP("auto")`` on the world's group, "hsdp"
``FSDP("auto", mesh=...)``, and neither "zero2" nor "checkpoint" are combinations a user can ask for.

One case beyond the covering (:data:`ONE_PLAN`) holds the one-plan seam: the default units with the cost a CUDA
user gets (``cost="h100-nvlink"``) and first batches of other shapes on each rank (rows and tokens,
:data:`SHAPES` ``"plans"``), from which a rank planning alone would choose other units; it reports what each rank
would have planned alone (``tests/agreement_cases.plan_alone``) beside the plan it compiled at each step.

The reference (:class:`Reference`) is one process: the same model from the same seed, with float32 master
weights and the same optimizer. In float32 it is the eager model on the whole global batch (the ranks' rows and
micro-batches together) when every rank has the same lengths, and the mean over the ranks of each rank's loss
when they are ragged (what data-parallel training averages: each rank's loss is a mean over its own tokens).
In low precision it makes the same casts as FSDP's ``MixedPrecision``: each rank's micro-batch through a copy
of the model whose parameters are the master weights cast to the compute dtype (int8: quantized and
dequantized per shard by the documented rule, ``tests/quantized_cases.dequantized``), jitted by plain Thunder
so both sides round the same decomposed ops, each gradient cast to float32, summed over the micro-batches,
then over the ranks, divided by the ranks (and by the loss scale, a power of two).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import time

import thunder
import torch
import torch.distributed as dist
from fsdp_pass_executors import executors_for

import fsdp_pass
from fsdp_pass import FSDP, MixedPrecision, fsdp_of, full_state_dict, no_sync
from fsdp_pass.op_names import ALL_REDUCE, REDUCE_SCATTER
from fsdp_pass.predicates import is_finite_check
from fsdp_pass.report.measure import CollectiveBytes
from fsdp_pass.shard.global_view import gather_full
from tests import hsdp_cases, models, tolerances
from tests.agreement_cases import _planned, plan_alone
from tests.quantized_cases import dequantized
from tests.rank_cases import _rel, _worst

FACTORS = {  # the two four-valued factors first: the construction starts from their 16 pairs
    "precision": ("fp32", "bf16", "int8", "fp16"),
    "feature": ("check_finite", "offload", "no_sync", "checkpoint"),
    "units": ("default", "blocks", "auto"),
    "strategy": ("zero2", "zero3", "hsdp"),
    "lengths": ("equal", "ragged"),
}

# how far each precision's step may lie from its reference (tests/tolerances.py says why): float32 against the
# eager model (Thunder's decomposed ops round a little differently); the others against a reference that makes
# the same casts through the same decomposed ops and sums in float32: identical up to the order of a float32 sum
TOLERANCE = {"fp32": tolerances.FLOAT32, "bf16": tolerances.SAME_CASTS, "int8": tolerances.SAME_CASTS,
             "fp16": tolerances.SAME_CASTS}

MODEL = "lean_lm"
# one decoder block of width 32 (attention, RMS norms, an MLP: tests/models.py LeanLM), and "blocks" still makes four
# units; a compile is most of a case's time, so the model has few modules and ops: the tiny GQA Llama's block (rotary
# tables, grouped heads, norm modules) compiled in about twice the time, and two blocks in twice that
CONFIG = {"d": 32, "n_layer": 1, "hidden": 48}
# (sequences, tokens per sequence) of each micro-batch on rank 0, rank 1. "plans" (the case beyond the covering,
# ONE_PLAN): a rank planning from its own first batch alone would choose other default units than the other rank
# under cost="h100-nvlink" (rank 0's one row of 4 tokens: 'embed' and 'layers..lm_head'; rank 1's: one unit)
SHAPES = {"equal": ((2, 8), (2, 8)), "ragged": ((2, 8), (2, 5)), "plans": ((1, 4), (4, 8))}
STEPS = 2  # the second step gathers what the optimizer stepped
# SGD with momentum: its update is linear in the gradient, so the parameters after a step hold the gradients'
# tolerance. AdamW's first update divides each gradient element by its own magnitude, and float32 rounding in an
# element near zero became a full-size difference (4.8e-4 relative on fp32-no_sync-equal, gradients within 3e-7)
LR, MOMENTUM = 0.1, 0.9
SCALE = 2.0**10  # float16's loss scale: a power of two, so scaling and unscaling are exact on both sides
MESH = (2, 1)  # HSDP: (replicas, ranks per shard group)
PRECISIONS = {
    "fp32": None,
    "bf16": MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32),
    "int8": MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32,
                           gather_dtype=torch.int8),
    "fp16": MixedPrecision(torch.float16, reduce_dtype=torch.float32, output_dtype=torch.float32),
}


def allowed(combination: dict) -> bool:
    """Whether a (partial) combination is one a user can ask for (the module docstring says why not)."""
    auto = combination.get("units") == "auto"
    return not (auto and (combination.get("strategy") == "zero2" or combination.get("feature") == "checkpoint"))


def _covers(row: dict, pair) -> bool:
    (a, va), (b, vb) = pair
    return row.get(a) == va and row.get(b) == vb


def all_pairs(factors: dict, allowed=allowed) -> list[dict]:
    """A pairwise covering of ``factors`` (name -> values), greedy and deterministic: while a pair of values of
    two factors is in no row yet, a new row starts from the first such pair (in the order of ``factors``), and
    each other factor takes, in order, the first of its allowed values that puts the most uncovered pairs
    into the row."""
    names = list(factors)
    uncovered = [((a, va), (b, vb)) for a, b in itertools.combinations(names, 2)
                 for va in factors[a] for vb in factors[b] if allowed({a: va, b: vb})]
    rows = []
    while uncovered:
        row = dict(uncovered[0])
        for name in (n for n in names if n not in row):
            def gain(value):
                trial = row | {name: value}
                return sum(1 for pair in uncovered if name in (pair[0][0], pair[1][0]) and _covers(trial, pair))
            row[name] = max((v for v in factors[name] if allowed(row | {name: v})), key=gain)
        row = {n: row[n] for n in names}
        uncovered = [pair for pair in uncovered if not _covers(row, pair)]
        rows.append(row)
    return rows


# beyond the covering, the one-plan seam: the default units with the cost a CUDA user gets, and first batches that
# would make each rank choose other units planning alone (the test asserts they would): every rank plans from the
# same step
ONE_PLAN = {"precision": "fp32", "feature": "check_finite", "units": "default", "strategy": "zero3",
            "lengths": "plans", "cost": "h100-nvlink"}
CASES = all_pairs(FACTORS) + [ONE_PLAN]


def case_id(case: dict) -> str:
    return "-".join([case[n] for n in FACTORS] + ([case["cost"]] if "cost" in case else []))


def transform_for(case: dict) -> FSDP:
    """The ``FSDP(...)`` a user writes for ``case``."""
    kwargs = {}
    if case["units"] == "blocks":
        kwargs["units"] = "blocks"
    if "cost" in case:
        kwargs["cost"] = case["cost"]
    if case["strategy"] == "hsdp":
        kwargs["mesh"] = hsdp_cases.mesh_of(MESH)
    if PRECISIONS[case["precision"]] is not None:
        kwargs["mixed_precision"] = PRECISIONS[case["precision"]]
    kwargs |= {"check_finite": {"check_finite": True}, "offload": {"offload_to": "cpu"},
               "checkpoint": {"checkpoint_activations": True}}.get(case["feature"], {})
    strategy = "auto" if case["units"] == "auto" else "zero3" if case["strategy"] == "hsdp" else case["strategy"]
    return FSDP(strategy, **kwargs)


def micro_batches(case: dict, step: int, world: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``[micro-batch][rank] -> (token ids, targets)``: two micro-batches under ``no_sync``, else one."""
    out = []
    for k in range(2 if case["feature"] == "no_sync" else 1):
        per_rank = []
        for r in range(world):
            g = torch.Generator().manual_seed(1000 * step + 10 * k + r)
            rows, seq = SHAPES[case["lengths"]][r]
            tokens = torch.randint(0, 37, (rows, seq + 1), generator=g)
            per_rank.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
        out.append(per_rank)
    return out


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return models.LeanLM(**CONFIG)


# compute dtype -> (the low-precision copy, its plain-Thunder jit), made once per rank process: every case of that
# dtype reuses its compiles (one per sequence length); each step copies the master weights into it
_LOW_COPIES: dict = {}


class Reference:
    """One process training ``case``'s model as FSDP should (the module docstring): ``step`` puts the gradients
    into the master model's ``.grad`` and returns each micro-batch's and rank's loss; ``optimizer`` steps it."""

    def __init__(self, case: dict, world: int):
        self.case, self.world = case, world
        self.master = build_model()
        self.precision = PRECISIONS[case["precision"]]
        self.scale = SCALE if case["precision"] == "fp16" else 1.0
        self.shard_ranks = MESH[1] if case["strategy"] == "hsdp" else world
        self.optimizer = torch.optim.SGD(self.master.parameters(), lr=LR, momentum=MOMENTUM)
        if self.precision is not None:
            dtype = self.precision.param_dtype
            if dtype not in _LOW_COPIES:
                low = copy.deepcopy(self.master)
                for q in low.parameters():
                    q.data = q.data.to(dtype)
                _LOW_COPIES[dtype] = low, thunder.jit(low, executors=executors_for("cpu"))
            self.low, self.jitted = _LOW_COPIES[dtype]

    def step(self, batches) -> tuple[list[list[float]], float]:
        """(losses ``[micro-batch][rank]``, the mean loss over the ranks)."""
        self.optimizer.zero_grad()
        if self.precision is None:
            return self._float32_step(batches)
        return self._low_precision_step(batches)

    def _float32_step(self, batches):
        micro = len(batches)
        with torch.no_grad():
            losses = [[float(models.loss_fn(MODEL, self.master(x), y)) for x, y in per_rank] for per_rank in batches]
        if self.case["lengths"] == "equal":  # the whole global batch at once
            x, y = (torch.cat(ts) for ts in zip(*[xy for per_rank in batches for xy in per_rank]))
            loss = models.loss_fn(MODEL, self.master(x), y)
        else:  # each rank's loss a mean over its own tokens, then the mean over ranks and micro-batches
            loss = sum(models.loss_fn(MODEL, self.master(x), y) for per_rank in batches for x, y in per_rank)
            loss = loss / (micro * self.world)
        loss.backward()
        return losses, float(loss.detach())

    def _load_low_copy(self):
        with torch.no_grad():
            for p, q in zip(self.master.parameters(), self.low.parameters()):
                value = p.detach()
                if self.precision.gather_dtype is not None:
                    value = dequantized(value, self.shard_ranks, self.precision.gather_block,
                                        self.precision.gather_dtype, torch.float32)
                q.copy_(value.to(q.dtype))
                q.grad = None

    def _slice_grads(self, x, y, micro: int) -> tuple[float, list[torch.Tensor]]:
        """One rank's micro-batch through the low-precision copy: its loss, and each gradient cast to float32."""
        loss = models.loss_fn(MODEL, self.jitted(x).float(), y)
        (loss / micro * self.scale).backward()
        grads = [q.grad.float() for q in self.low.parameters()]
        for q in self.low.parameters():
            q.grad = None
        return float(loss.detach()), grads

    def _low_precision_step(self, batches):
        """Every (micro-batch, rank) slice through the low-precision copy, each computed on the first rank whose own
        sequence length is that slice's (each rank compiles the copy for its own length only), the results
        gathered to every rank and summed in one order: per rank over its micro-batches, then over the ranks."""
        self._load_low_copy()
        rank, micro, lengths = dist.get_rank(), len(batches), SHAPES[self.case["lengths"]]
        computes = [lengths.index(lengths[r]) for r in range(self.world)]  # slice r -> the rank that computes it
        mine = {(k, r): self._slice_grads(x, y, micro) for k, per_rank in enumerate(batches)
                for r, (x, y) in enumerate(per_rank) if computes[r] == rank}
        parts = [None] * self.world
        dist.all_gather_object(parts, mine)
        results = {key: value for part in parts for key, value in part.items()}
        losses = [[results[k, r][0] for r in range(self.world)] for k in range(micro)]
        for i, p in enumerate(self.master.parameters()):
            per_rank = []
            for r in range(self.world):  # FSDP accumulates the micro-batches in the reduce dtype, then reduces
                total = results[0, r][1][i]
                for k in range(1, micro):
                    total = total + results[k, r][1][i]
                per_rank.append(total)
            total = per_rank[0]
            for g in per_rank[1:]:
                total = total + g
            p.grad = total / self.world / self.scale
        return losses, sum(map(sum, losses)) / (micro * self.world)


def _grad_errors(jm, fsdp, reference: Reference) -> dict[str, float]:
    """Each trainable parameter's gradient, gathered whole, against the reference's (relative to its largest)."""
    named = dict(reference.master.named_parameters())
    return {s.name: _rel(gather_full(jm.get_parameter(s.name).grad, s.layout, fsdp.group), named[s.name].grad)
            for s in fsdp.sharding.owners() if s.requires_grad}


def _fsdp_step(jm, batches, rank: int, scaler, opt) -> tuple[list[float], list[int]]:
    """This rank's micro-batches, all but the last under ``no_sync``; the gradients unscaled. Its losses, and the
    reduce-scatters and all-reduces each micro-batch issued."""
    losses, reductions = [], []
    for k, per_rank in enumerate(batches):
        x, y = per_rank[rank]
        last = k == len(batches) - 1
        with CollectiveBytes() as sent, contextlib.nullcontext() if last else no_sync(jm):
            loss = models.loss_fn(MODEL, jm(x), y)
            scaled = loss / len(batches)
            (scaled if scaler is None else scaler.scale(scaled)).backward()
        losses.append(float(loss.detach()))
        reductions.append(sum(kind in (REDUCE_SCATTER, ALL_REDUCE) for kind, _ in sent.calls))
    if scaler is not None:
        scaler.unscale_(opt)
    return losses, reductions


def seam_case(case: dict) -> dict:
    """Train ``case`` for :data:`STEPS` steps on this rank and the reference in this process; the worst relative
    errors of this rank's losses, of the mean loss, of each parameter's gradient (every step) and of the
    parameters after each optimizer step; the units every rank planned; what shows the feature is in the step."""
    started, cpu_started = time.perf_counter(), time.process_time()
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = Reference(case, world)
    jm = thunder.jit(copy.deepcopy(reference.master), transforms=[transform_for(case)], executors=executors_for("cpu"))
    fsdp = fsdp_of(jm)
    opt = torch.optim.SGD(jm.parameters(), lr=LR, momentum=MOMENTUM)
    scaler = fsdp_pass.GradScaler(jm, init_scale=SCALE) if case["precision"] == "fp16" else None
    out = {"loss": [], "mean_loss": [], "grad": {}, "param": [], "losses": [], "reductions": [], "plans": []}
    for step in range(STEPS):
        batches = micro_batches(case, step, world)
        ref_losses, ref_mean = reference.step(batches)
        opt.zero_grad()
        losses, reductions = _fsdp_step(jm, batches, rank, scaler, opt)
        out["losses"].append(losses)
        out["reductions"].append(reductions)
        out["plans"].append(_planned(fsdp.compiled_step.plan))
        if step == 0 and "cost" in case:  # what this rank's first batch alone would have planned
            out["alone"] = plan_alone(fsdp.compiled_step.plan.summary, "zero3", cost=case["cost"])
        out["loss"] += [abs(ours - ref[rank]) / ref[rank] for ours, ref in zip(losses, ref_losses)]
        mean = torch.tensor(sum(losses) / len(losses))
        dist.all_reduce(mean)
        out["mean_loss"].append(abs(float(mean) / world - ref_mean) / ref_mean)
        for name, err in _grad_errors(jm, fsdp, reference).items():
            out["grad"][name] = _worst([out["grad"].get(name, 0.0), err])
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        reference.optimizer.step()
        full = full_state_dict(jm)
        out["param"].append(_worst(_rel(full[n], p.detach()) for n, p in reference.master.named_parameters()))
    forward = thunder.last_traces(jm)[-1]
    return out | {
        "units": [u.name for u in fsdp.unit_plan.units],
        "scale": None if scaler is None else scaler.get_scale(),
        "finite_checks": sum(map(is_finite_check, forward.bound_symbols)),
        "seconds": time.perf_counter() - started,
        "cpu_seconds": time.process_time() - cpu_started,  # this rank's: its wall time on an idle core of its own
    }
