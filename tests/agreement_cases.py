"""Rank functions for tests/test_ranks_agree.py: ranks whose inputs differ in shape, whose steps would issue
different collectives, and collective helpers called on one rank only."""

from __future__ import annotations

import copy
import time

import thunder
import torch
import torch.distributed as dist
from fsdp_pass_executors import executors_for
from torch import nn

from fsdp_pass import FSDP, FSDPError, fsdp_of, full_state_dict
from fsdp_pass.predicates import is_collective, is_step_check
from fsdp_pass.report.measure import CollectiveBytes
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
    start = time.monotonic()
    with CollectiveBytes() as sent:  # the step's all-gathers and reduce-scatters, issued before the error or not
        try:
            jm(torch.randn(6 if rank == 1 else 2, 16)).sum().backward()
            message = "no error"
        except FSDPError as e:
            message = str(e)
    seconds = time.monotonic() - start
    # nothing was left in flight: the group still runs a collective
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"message": message, "seconds": seconds, "group_still_works": float(t) == dist.get_world_size(),
            "collectives_before_the_error": [(str(kind), size) for kind, size in sent.calls]}


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
    start = time.monotonic()
    with CollectiveBytes() as sent:
        try:
            jm(batch(3, rank)).square().mean().backward()
            message = "no error"
        except FSDPError as e:
            message = str(e)
    seconds = time.monotonic() - start
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"param_err": param_err, "message": message, "seconds": seconds,
            "collectives_before_the_error": [(str(kind), size) for kind, size in sent.calls],
            "group_still_works": float(t) == world, "compiles": thunder.cache_misses(jm)}


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
