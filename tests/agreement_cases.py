"""Rank functions for tests/test_ranks_agree.py: ranks whose inputs differ in shape, whose steps would issue
different collectives, and collective helpers called on one rank only."""

from __future__ import annotations

import copy
import time

import thunder
import torch
import torch.distributed as dist
from fsdp_pass_executors import executors_for
from thunder.core import utils
from torch import nn

from fsdp_pass import FSDP, FSDPError, fsdp_of, full_state_dict
from fsdp_pass.functional import derive_backward_and_lower, functional_trace, shard_functional_trace
from fsdp_pass.search.auto_plan import plan_step
from fsdp_pass.cost.cost_model import DEFAULTS
from fsdp_pass.search.default_units import candidate, choose_units
from fsdp_pass.search.last_unit import starts_of
from fsdp_pass.plan.layout import shard_tensor
from fsdp_pass.plan.options import FSDPOptions
from fsdp_pass.search.unit_search import block_starts
from fsdp_pass.predicates import is_collective, is_step_check
from fsdp_pass.report.measure import CollectiveBytes
from fsdp_pass.shard.global_view import gather_full
from tests import models

# tokens per rank at each step: ranks differ, and each rank's own shape changes, so that at step 1 only rank 1
# compiles a new variant and at step 2 only rank 0 does (the other runs a variant it has)
RAGGED_SEQ = [(6, 8), (6, 6), (8, 6)]
RAGGED_BATCH = [(2, 3), (2, 3), (1, 3)]


def _tokens(step: int, rank: int, seq: int, batch: int):
    g = torch.Generator().manual_seed(10 * step + rank)
    t = torch.randint(0, 37, (batch, seq + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def ragged_inputs_train(strategy: str, lr: float = 0.5):
    """Each rank trains on batches of its own shapes (sequence length and batch size differ between the ranks
    and between steps) with SGD; the single-process reference averages the ranks' gradients, as FSDP does."""
    rank, world = dist.get_rank(), dist.get_world_size()
    # one decoder layer: what differs between the shapes (the batch, attention over the sequence) is all in one,
    # and each rank compiles two variants (a second layer made the test ~40 % more CPU time)
    reference = models.build("llama_gqa", config={"n_layer": 1})
    jm = thunder.jit(copy.deepcopy(reference), transforms=[FSDP(strategy)], executors=executors_for("cpu"))
    opt = torch.optim.SGD(jm.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr)
    loss_err, checks = [], []
    for step, (seqs, batches) in enumerate(zip(RAGGED_SEQ, RAGGED_BATCH)):
        ref_opt.zero_grad()
        ref_losses = []
        for r in range(world):
            x, y = _tokens(step, r, seqs[r], batches[r])
            ref_loss = models.loss_fn("llama_gqa", reference(x), y) / world
            ref_loss.backward()
            ref_losses.append(float(ref_loss) * world)
        x, y = _tokens(step, rank, seqs[rank], batches[rank])
        opt.zero_grad()
        loss = models.loss_fn("llama_gqa", jm(x), y)
        loss.backward()
        opt.step()
        ref_opt.step()
        loss_err.append(abs(float(loss) - ref_losses[rank]) / ref_losses[rank])
        forward = thunder.last_traces(jm)[-1]
        checks.append(sum(is_step_check(b) for b in forward.bound_symbols))
    full = full_state_dict(jm)
    param_err = max(float((full[n] - p).abs().max() / p.abs().max()) for n, p in reference.state_dict().items())
    first = next(i for i, b in enumerate(forward.bound_symbols) if is_step_check(b) or is_collective(b))
    return {
        "loss_rel_err": max(loss_err),
        "param_rel_err": param_err,
        "compiles": thunder.cache_misses(jm),
        "step_checks_per_forward": checks,
        "check_comes_first": is_step_check(forward.bound_symbols[first]),
        "check_printed": "check_same_collectives(" in str(forward),
    }


# The first batches (rows, tokens) of rank 0 and rank 1. Planning alone from its own first step, each rank would choose
# another plan (the test asserts it, so it cannot pass for want of a difference): under the default units, rank 1's
# larger step reshards the last unit where rank 0's keeps it; under FSDP("auto", memory_budget=AUTO_BUDGET) rank 0's
# fits one unit, rank 1's needs two and checkpointing. At step 1 the ranks swap them: each compiles a second variant
# on its own, which no collective can settle.
FIRST_BATCHES = ((4, 8), (32, 8))
AUTO_BUDGET = 400_000  # bytes per rank (the one-unit plan's predicted peak: 88 KiB for (4, 8), 466 KiB for (32, 8))
ONE_LAYER = {"n_layer": 1}


def _ragged_batch(step: int, rank: int):
    rows, seq = FIRST_BATCHES[rank if step == 0 else 1 - rank]
    return _tokens(100 + step, rank, seq, rows)


def plan_alone(summary, strategy: str, **fsdp_kwargs) -> tuple:
    """What a rank planning from the step ``summary`` alone would choose with ``FSDP(strategy, **fsdp_kwargs)`` on
    the CPU (with the ``cost=`` passed, else the CPU's): (unit names, which reshard after forward, the checkpointed
    units' levels), by the library's own decisions on that one summary."""
    options = FSDPOptions.resolve(strategy, **fsdp_kwargs)
    cost = getattr(options.unit_policy, "cost", None) or DEFAULTS["cpu-gloo"]
    if options.auto is not None:
        auto = plan_step(summary, cost, options.auto.memory_budget)
        names = tuple(name for name, _ in auto.groups)
        return names, tuple(n in auto.resharded for n in names), tuple(sorted(auto.checkpoint_by_unit.items()))
    choice = choose_units(summary, options, cost, None)
    starts = block_starts(summary) if choice.prediction is None else starts_of(summary, [ps for _, ps in choice.groups])
    return choice.names, candidate(starts, options, summary).reshard, ()


def _planned(plan) -> tuple:
    """A compiled plan as :func:`plan_alone` describes one."""
    return (tuple(u.name for u in plan.units), tuple(u.reshard_after_forward for u in plan.units),
            tuple((u.name, u.checkpoint) for u in plan.units if u.checkpointed))


def _reference_step(reference, batches) -> list[float]:
    """Each rank's loss on its batch of ``batches`` (one per rank), computed by the single-process reference, whose
    gradients become the ranks' mean."""
    losses = []
    for x, y in batches:
        loss = models.loss_fn("llama_gqa", reference(x), y) / len(batches)
        loss.backward()
        losses.append(loss.item() * len(batches))
    return losses


def ragged_first_batches_train(strategy: str, lr: float = 0.5, **fsdp_kwargs):
    """Each rank's first batch has its own shape (:data:`FIRST_BATCHES`), then they swap; SGD against one process
    that averages the ranks' gradients. Returns the plan each rank compiled, the one it would have planned alone,
    each step's worst loss error and per-parameter gradient errors, and the parameters' error after the steps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = models.build("llama_gqa", config=ONE_LAYER)
    jm = thunder.jit(copy.deepcopy(reference), transforms=[FSDP(strategy, **fsdp_kwargs)],
                     executors=executors_for("cpu"))
    fsdp = fsdp_of(jm)
    opt, ref_opt = torch.optim.SGD(jm.parameters(), lr=lr), torch.optim.SGD(reference.parameters(), lr=lr)
    ref_params = dict(reference.named_parameters())
    loss_err, grad_err, plans = [], {}, []
    for step in range(2):
        ref_opt.zero_grad()
        ref_losses = _reference_step(reference, [_ragged_batch(step, r) for r in range(world)])
        x, y = _ragged_batch(step, rank)
        opt.zero_grad()
        loss = models.loss_fn("llama_gqa", jm(x), y)
        loss.backward()
        loss_err.append(abs(float(loss) - ref_losses[rank]) / ref_losses[rank])
        for spec in fsdp.sharding.owners():
            full = gather_full(jm.get_parameter(spec.name).grad, spec.layout, fsdp.group)
            ref = ref_params[spec.name].grad
            err = float((full - ref).abs().max() / ref.abs().max())
            grad_err[spec.name] = max(grad_err.get(spec.name, 0.0), err)
        plans.append(_planned(fsdp.compiled_step.plan))
        if step == 0:
            alone = plan_alone(fsdp.compiled_step.plan.summary, strategy, **fsdp_kwargs)
        opt.step()
        ref_opt.step()
    full = full_state_dict(jm)
    param_err = max(float((full[n] - p).abs().max() / p.abs().max()) for n, p in reference.state_dict().items())
    return {"alone": alone, "plans": plans, "loss_rel_err": max(loss_err), "grad_rel_err": grad_err,
            "param_rel_err": param_err, "compiles": thunder.cache_misses(jm),
            "explain": str(fsdp.explain())}


def _trace_values(prologue, computation, model, inputs) -> dict:
    """Each argument of ``computation`` by name: the module's parameter or buffer the prologue reads into it, else the
    next of ``inputs``."""
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    producers, values, rest = utils.producers(prologue), {}, iter(inputs)
    for out, arg in zip(prologue.output[0], computation.args):
        read = producers.get(out, None)
        name = read.args[-1] if read is not None and read.args and isinstance(read.args[-1], str) else None
        values[arg.name] = tensors[name] if name in tensors else next(rest)
    return values


def ragged_first_batches_functional(lr: float = 0.5):
    """The functional path on every rank, each with its own first batch (:data:`FIRST_BATCHES`), over the real
    group: stages 1-3, autodiff and lowering, then the traces run: two SGD steps on the shards (the same batches:
    the traces are made for them) against one process. Returns what :func:`ragged_first_batches_train` does but the
    parameters' error (the shards are compared through their gradients at each step)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = models.build("llama_gqa", config=ONE_LAYER)
    reference = copy.deepcopy(model)
    x, y = _ragged_batch(0, rank)
    prologue, computation = functional_trace(model, x)
    sharded, plan = shard_functional_trace(prologue, computation, dist.group.WORLD, "zero3", units=None, model=model)
    alone, planned = plan_alone(plan.summary, "zero3"), _planned(plan)
    plans: list = [None] * world
    dist.all_gather_object(plans, planned)
    result = {"alone": alone, "plans": plans, "loss_rel_err": float("nan"), "grad_rel_err": {}}
    if any(p != planned for p in plans):  # the traces would issue different collectives: do not run them
        return result
    forward, backward = derive_backward_and_lower(sharded, plan)
    run_forward, run_backward = forward.python_callable(), backward.python_callable()
    values = _trace_values(prologue, computation, model, [x])
    param_of_arg = plan.param_of_arg
    shards = {a: shard_tensor(values[a].detach(), plan.sharding.param(p).layout, rank).clone()
              for a, p in param_of_arg.items()}
    ref_params, loss_err = dict(reference.named_parameters()), []
    for step in range(2):
        reference.zero_grad()
        ref_losses = _reference_step(reference, [_ragged_batch(0, r) for r in range(world)])
        args = [shards.get(a.name, values[a.name]) for a in sharded.args]
        out, saved = run_forward(*args)
        logits = out["output"][0] if isinstance(out["output"], tuple) else out["output"]
        logits = logits.detach().requires_grad_()
        loss = models.loss_fn("llama_gqa", logits, y)
        (cotangent,) = torch.autograd.grad(loss, logits)
        grads = run_backward([list(saved[0]), list(saved[1])], [cotangent])
        loss_err.append(abs(float(loss) - ref_losses[rank]) / ref_losses[rank])
        for a, g in zip((a.name for a in sharded.args), grads):
            if a not in param_of_arg:
                continue
            spec = plan.sharding.param(param_of_arg[a])
            full = gather_full(g, spec.layout, dist.group.WORLD)
            ref = ref_params[spec.name].grad
            err = float((full - ref).abs().max() / ref.abs().max())
            result["grad_rel_err"][spec.name] = max(result["grad_rel_err"].get(spec.name, 0.0), err)
            shards[a] = shards[a] - lr * g
        with torch.no_grad():
            for p in reference.parameters():
                p -= lr * p.grad
    result["loss_rel_err"] = max(loss_err)
    return result


class LongInputsTakeAnExtraLayer(nn.Module):
    """A model whose collectives depend on its input: batches longer than 4 rows go through one more layer."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.extra = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if x.shape[0] > 4:
            h = torch.tanh(self.extra(h))
        return self.head(h)


def different_collectives_at_a_later_step():
    """Step 0: both ranks feed 2 rows. Step 1: rank 1 feeds 6 rows, so its step gathers one more layer. Every
    rank must raise an FSDPError at step 1, before any collective of it, naming the first that differs; and the
    group must still work afterwards."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    jm = thunder.jit(
        LongInputsTakeAnExtraLayer(), transforms=[FSDP("zero3", units="per_parameter")], executors=executors_for("cpu")
    )
    jm(torch.randn(2, 16)).sum().backward()
    return _step_that_raises(lambda: jm(torch.randn(6 if rank == 1 else 2, 16)).sum().backward())


def _step_that_raises(step) -> dict:
    """Run ``step()``, which should raise an FSDPError on every rank: its message, how long it took, the collectives
    issued before the error (all-gathers and reduce-scatters), and whether the group still runs a collective
    afterwards (nothing was left in flight)."""
    start = time.monotonic()
    with CollectiveBytes() as sent:
        try:
            step()
            message = "no error"
        except FSDPError as e:
            message = str(e)
    seconds = time.monotonic() - start
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"message": message, "seconds": seconds, "group_still_works": float(t) == dist.get_world_size(),
            "collectives_before_the_error": [(str(kind), size) for kind, size in sent.calls]}


def different_parameters_at_the_first_step():
    """Rank 1's first batch has 6 rows, so its first step reads a layer rank 0's does not: at the first compile, where
    the ranks agree on the step they plan from, every rank raises the same FSDPError, before any collective of the
    step; the group still works afterwards."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    jm = thunder.jit(LongInputsTakeAnExtraLayer(), transforms=[FSDP("zero3")], executors=executors_for("cpu"))
    return _step_that_raises(lambda: jm(torch.randn(6 if rank == 1 else 2, 16)).sum().backward())


class LongInputsStartWithAnExtraLayer(nn.Module):
    """A model whose first collective depends on its input: batches longer than 4 rows start with one more layer
    (of another shape than the first one's, so the step's first collective differs in size too)."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(16, 16)
        self.inp = nn.Linear(16, 24)
        self.head = nn.Linear(24, 4)

    def forward(self, x):
        if x.shape[0] > 4:
            x = torch.tanh(self.pre(x))
        return self.head(torch.tanh(self.inp(x)))


# rows per rank at each step: step 1 every rank starts with 'pre' (the first collective changes on every rank
# alike), step 2 every rank is back, step 3 rank 1 alone starts with 'pre'
FIRST_CHANGES_ROWS = [(2, 2), (6, 6), (2, 2), (2, 6)]


def first_collective_changes_then_ranks_diverge(lr: float = 0.1):
    """Steps 0-2: the ranks change their step's first collective together, twice, and train as one process
    (SGD, gradients averaged) would. Step 3: rank 1 alone starts with another collective: every rank raises
    before any mismatched collective (each issued the same one: the first of the step they agreed on)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = LongInputsStartWithAnExtraLayer()
    jm = thunder.jit(copy.deepcopy(reference), transforms=[FSDP("zero3", units="per_parameter")],
                     executors=executors_for("cpu"))
    opt, ref_opt = torch.optim.SGD(jm.parameters(), lr=lr), torch.optim.SGD(reference.parameters(), lr=lr)

    def batch(step, r):
        return torch.randn(FIRST_CHANGES_ROWS[step][r], 16, generator=torch.Generator().manual_seed(10 * step + r))

    for step in range(3):
        jm(batch(step, rank)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        for r in range(world):
            (reference(batch(step, r)).square().mean() / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = full_state_dict(jm)
    param_err = max(float((full[n] - p).abs().max()) for n, p in reference.state_dict().items())
    raised = _step_that_raises(lambda: jm(batch(3, rank)).square().mean().backward())
    return {"param_err": param_err, **raised, "compiles": thunder.cache_misses(jm)}


def helper_on_one_rank(timeout_s: float):
    """Rank 0 alone calls full_state_dict(): it must raise within about ``timeout_s``, naming the helper and
    rank 1; rank 1 goes on. Then both call it, and it works (the failed call left nothing behind)."""
    rank = dist.get_rank()
    jm = thunder.jit(
        models.build("mlp"), transforms=[FSDP("zero2", timeout=timeout_s)], executors=executors_for("cpu")
    )
    message, seconds = "not called", 0.0
    if rank == 0:
        start = time.monotonic()
        try:
            full_state_dict(jm)
            message = "no error"
        except FSDPError as e:
            message = str(e)
        seconds = time.monotonic() - start
    dist.barrier()
    # a later model's helpers count their calls afresh: the call rank 0 gave up on does not shift them
    again = thunder.jit(models.build("mlp"), transforms=[FSDP("zero2")], executors=executors_for("cpu"))
    full = full_state_dict(again)
    return {"message": message, "seconds": seconds, "later_helper_works": sorted(full) == sorted(
        models.build("mlp").state_dict()), "timeout": fsdp_of(jm).options.timeout.total_seconds()}


def late_arrival(timeout_s: float):
    """Rank 1 comes to full_state_dict() after rank 0 stopped waiting: both raise (rank 1 must not go on alone
    into the gather)."""
    rank = dist.get_rank()
    jm = thunder.jit(
        models.build("mlp"), transforms=[FSDP("zero2", timeout=timeout_s)], executors=executors_for("cpu")
    )
    if rank == 1:
        time.sleep(timeout_s + 2)
    try:
        full_state_dict(jm)
        return "no error"
    except FSDPError as e:
        return str(e)
