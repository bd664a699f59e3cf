"""One way to fail: every user-facing error says what went wrong and what to do about it."""

from __future__ import annotations


class FSDPError(RuntimeError):
    """Raised for misuse of the FSDP pass. The message always ends with what to do."""


def fail(what: str, todo: str) -> None:
    """Raise :class:`FSDPError` with ``what`` went wrong and ``todo``, the fix."""
    raise FSDPError(f"{what}\n  What to do: {todo}")


def check(condition: bool, what, todo: str) -> None:
    """:func:`fail` unless ``condition``; ``what`` may be a callable so the message is built lazily."""
    if not condition:
        fail(what() if callable(what) else what, todo)
