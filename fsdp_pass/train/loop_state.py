"""A checkpoint's ``loop.pt``: the step and the user's ``extra``, written with ``torch.save`` (fsynced) and read
with ``torch.load(..., weights_only=True)``, so reading it runs no code from the file; and the per-rank
``extra-00003.pt`` files of a save whose ranks passed different extras.

``refused_part(value, path="extra") -> str | None``
  The first part of ``value`` that ``weights_only`` loading would refuse, as its path and type
  (``extra['schedule']['fn'] is a function``), or None. Accepted, as torch accepts them: tensors (plain
  ``torch.Tensor`` or ``nn.Parameter``, not subclasses such as DTensor), None, bools, ints, floats,
  complex numbers, strings, bytes, ``torch.dtype``, ``torch.device``, ``torch.Size``, and dicts
  (``OrderedDict`` too), lists, tuples and sets of them; e.g. an LR scheduler's ``state_dict()``.

``write_loop_state(path, step, extra, world_size, extra_digests)``: ``torch.save`` of them, fsynced; ``extra`` is
None where ``extra_digests`` differ (each rank's extra is then in ``rank_extra_file(rank)``, :func:`write_value`).

``read_value(path, map_location) -> (value, problem)``: ``torch.load(path, map_location, weights_only=True)``; a
refusal (a pickle that names a function or a class), a tensor on a device this process lacks, or any other
failure is a problem, ``(what is wrong, what to do)``, and value is None.

``read_loop_state(path, map_location) -> (state, problem)``: :func:`read_value`, then the value must be a dict
with ``step`` and ``extra``; one written before extras were per rank has no ``extra_digests`` (one extra).
"""

from __future__ import annotations

import collections
import os
import pickle
import re

import torch

LOOP_FILE = "loop.pt"

_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_TENSORS = (torch.Tensor, torch.nn.Parameter)  # exact types: a subclass needs an allowlist to load
MAPPINGS = (dict, collections.OrderedDict)
_SEQUENCES = (list, tuple, set, torch.Size)
_TRUST = (
    "Load only checkpoints written by fsdp_pass.save_checkpoint from a source you trust; its extra holds only "
    "tensors, numbers, strings and containers of them."
)


def rank_extra_file(rank: int) -> str:
    return f"extra-{rank:05d}.pt"


def describe(value) -> str:
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def refused_part(value, path: str = "extra") -> str | None:
    """Path and type of the first part of ``value`` that ``torch.load(weights_only=True)`` would refuse."""
    kind = type(value)
    if kind in _SCALARS or kind in _TENSORS:
        return None
    if kind in MAPPINGS:
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
    return f"{path} is a {describe(value)}"


def write_value(path, value) -> None:
    """``torch.save``, then fsync: on disk before the checkpoint is published and older ones are deleted."""
    with open(path, "wb") as f:
        torch.save(value, f)
        f.flush()
        os.fsync(f.fileno())


def write_loop_state(path, step: int, extra, world_size: int, extra_digests: list[str]) -> None:
    one = len(set(extra_digests)) == 1
    state = {"step": step, "extra": extra if one else None, "world_size": world_size, "extra_digests": extra_digests}
    write_value(path, state)


def _refusal_reason(error: Exception) -> str:
    """The one line of torch's weights_only refusal that names what the file asked for."""
    found = re.search(r"WeightsUnpickler error: (.*?)(?: Please use|\n|$)", str(error))
    return found.group(1).strip() if found else f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"


def _read_problem(name: str, error: Exception, map_location) -> tuple[str, str]:
    """(what went wrong, what to do) for a failed ``torch.load`` of ``name``."""
    if isinstance(error, pickle.UnpicklingError):
        return f"{name} was refused by torch.load(weights_only=True): {_refusal_reason(error)}", _TRUST
    text = str(error)
    device = re.search(r"deserialize object on (?:a )?(\w+) device", text)
    if device or "map_location" in text:
        where = f"a {device.group(1)} device" if device else "a device"
        return (
            f"{name} holds tensors saved on {where} that this process cannot use "
            f"(map_location={map_location!r}: {text.splitlines()[0][:160]})",
            "Pass map_location= to load_checkpoint: 'cpu', a torch.device, or a dict from the saved device to "
            "this one (as torch.load takes it), e.g. load_checkpoint(dir, jm, opt, map_location='cpu').",
        )
    return f"{name} cannot be read ({type(error).__name__}: {text.splitlines()[0][:200] if text else ''})", _TRUST


def read_value(path, map_location=None) -> tuple[object, tuple[str, str] | None]:
    """(the value, None), or (None, (what is wrong with the file, what to do)), without running code from it."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True), None
    except Exception as e:  # noqa: BLE001 - any failure to read is reported on every rank, not raised on one
        return None, _read_problem(os.path.basename(path), e, map_location)


def read_loop_state(path, map_location=None) -> tuple[dict | None, tuple[str, str] | None]:
    """(the loop state, None), or (None, (what is wrong with the file, what to do))."""
    state, problem = read_value(path, map_location)
    if problem is not None:
        return None, problem
    if not isinstance(state, dict) or not {"step", "extra"} <= set(state):
        kind = type(state).__name__
        return None, (f"{LOOP_FILE} holds a {kind}, not the dict with 'step' and 'extra' saves write", _TRUST)
    return state, None
