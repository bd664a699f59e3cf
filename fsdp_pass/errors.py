"""One way to fail: every user-facing error says what went wrong and what to do about it."""

from __future__ import annotations

import torch.distributed as dist


class FSDPError(RuntimeError):
    """Raised for misuse of the FSDP pass. The message always ends with what to do."""


def fail(what: str, todo: str) -> None:
    """Raise :class:`FSDPError` with ``what`` went wrong and ``todo``, the fix."""
    raise FSDPError(f"{what}\n  What to do: {todo}")


def check(condition: bool, what, todo: str) -> None:
    """:func:`fail` unless ``condition``; ``what`` may be a callable so the message is built lazily."""
    if not condition:
        fail(what() if callable(what) else what, todo)


def check_on_all_ranks(problem: str | None, todo: str, group) -> None:
    """Collective: every rank of ``group`` raises if any rank found a ``problem`` (a message, or None), so a
    check that one rank alone can fail (its own input, a file it reads) never leaves the others waiting in
    the next collective. The message names the first rank that failed."""
    problems = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    for rank, found in enumerate(problems):
        if found is not None:
            fail(found if rank == dist.get_rank(group) else f"(found on rank {rank}) {found}", todo)


def file_work_on_rank0(action, what: str, todo: str, group) -> None:
    """Collective: run ``action`` (work on files) on rank 0 of ``group``; if it raises an ``OSError``, every rank
    raises an FSDPError starting with ``what`` (and every rank waits for rank 0: a barrier)."""
    problem = None
    if dist.get_rank(group) == 0:
        try:
            action()
        except OSError as e:
            problem = f"{what}{type(e).__name__}: {e}"
    check_on_all_ranks(problem, todo, group)


def value_from_rank0(compute, todo: str, group):
    """Collective: ``compute()`` on rank 0 of ``group``, its value on every rank. If it raises, every rank raises an
    FSDPError with its message and ``todo`` (the others would otherwise wait for rank 0 in the next collective)."""
    sent = [None, None]
    if dist.get_rank(group) == 0:
        try:
            sent[0] = compute()
        except Exception as e:  # noqa: BLE001 - reported on every rank
            sent[1] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(sent, src=dist.get_global_rank(group, 0), group=group)
    check(sent[1] is None, lambda: sent[1], todo)
    return sent[0]


def first_problem(problem, group):
    """Collective: the first rank's ``problem`` (anything, or None for none) on every rank: one verdict."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, problem, group=group)
    return next((p for p in everyone if p is not None), None)
