"""A checkpoint's ``loop.pt``: the step and the user's ``extra``, written with ``torch.save`` and read with
``torch.load(..., weights_only=True)``, so reading it runs no code from the file.

``refused_part(value, path="extra") -> str | None``
  The first part of ``value`` that ``weights_only`` loading would refuse, as its path and type
  (``extra['schedule']['fn'] is a function``), or None. Accepted, as torch accepts them: tensors (plain
  ``torch.Tensor`` or ``nn.Parameter``, not subclasses such as DTensor), None, bools, ints, floats,
  complex numbers, strings, bytes, ``torch.dtype``, ``torch.device``, ``torch.Size``, and dicts
  (``OrderedDict`` too), lists, tuples and sets of them; e.g. an LR scheduler's ``state_dict()``.

``write_loop_state(path, step, extra, world_size)``: ``torch.save`` of the three.

``read_loop_state(path) -> (state, problem)``
  1. ``torch.load(path, weights_only=True)``; a refusal (a pickle that names a function or a class) or any
     other failure is a problem sentence, and state is None.
  2. The loaded value must be a dict with ``step`` and ``extra``.
"""

from __future__ import annotations

import collections
import re

import torch

LOOP_FILE = "loop.pt"

_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_TENSORS = (torch.Tensor, torch.nn.Parameter)  # exact types: a subclass needs an allowlist to load
_MAPPINGS = (dict, collections.OrderedDict)
_SEQUENCES = (list, tuple, set, torch.Size)


def _describe(value) -> str:
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def refused_part(value, path: str = "extra") -> str | None:
    """Path and type of the first part of ``value`` that ``torch.load(weights_only=True)`` would refuse."""
    kind = type(value)
    if kind in _SCALARS or kind in _TENSORS:
        return None
    if kind in _MAPPINGS:
        for key, item in value.items():
            found = refused_part(key, f"a key of {path}") or refused_part(item, f"{path}[{key!r}]")
            if found:
                return found
        return None
    if kind in _SEQUENCES:
        for i, item in enumerate(value):
            found = refused_part(item, f"{path}[{i}]")
            if found:
                return found
        return None
    return f"{path} is a {_describe(value)}"


def write_loop_state(path, step: int, extra, world_size: int) -> None:
    torch.save({"step": step, "extra": extra, "world_size": world_size}, path)


def _refusal_reason(error: Exception) -> str:
    """The one line of torch's weights_only refusal that names what the file asked for."""
    found = re.search(r"WeightsUnpickler error: (.*?)(?: Please use|\n|$)", str(error))
    return found.group(1).strip() if found else f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"


def read_loop_state(path) -> tuple[dict | None, str | None]:
    """(the loop state, None), or (None, what is wrong with the file), without running code from it."""
    try:
        state = torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to read is reported on every rank, not raised on one
        return None, f"{LOOP_FILE} was refused by torch.load(weights_only=True): {_refusal_reason(e)}"
    if not isinstance(state, dict) or not {"step", "extra"} <= set(state):
        return None, f"{LOOP_FILE} holds a {type(state).__name__}, not the dict with 'step' and 'extra' saves write"
    return state, None
