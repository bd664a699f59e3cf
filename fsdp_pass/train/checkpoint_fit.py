"""Does a checkpoint fit what it is loaded into? Its keys and global shapes, from DCP's metadata, against the
model's and the optimizers' state dicts, before anything is loaded: a checkpoint of another architecture or of
another optimizer is one sentence naming the first key that differs and both shapes.

``tensor_shapes(state_dict, prefix) -> {key: shape}``
  The tensors of a nested state dict under DCP's flat keys (``model.fc1.weight``,
  ``optim.state.fc1.weight.exp_avg``): dict keys and list indices joined by dots; a DTensor's shape is its
  global shape, whatever the world size, so a checkpoint fits at any world size.

``saved_shapes(metadata) -> {key: shape | None}``: the same from DCP's ``Metadata`` (None: not a tensor).

``misfit(saved, ours, ours_to_load) -> str | None``
  1. Each of our keys, in order: absent from the checkpoint, not a tensor there, or of another shape.
  2. Each saved tensor we lack that ``ours_to_load(key)`` claims (the model's keys; the state of a parameter
     our optimizers hold): the checkpoint has more than what it is loaded into.
  3. The first of these, and how many more keys differ.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata


def tensor_shapes(state_dict, prefix: str) -> dict[str, tuple[int, ...]]:
    if isinstance(state_dict, torch.Tensor):
        return {prefix: tuple(state_dict.shape)}
    if isinstance(state_dict, dict):
        items = state_dict.items()
    elif isinstance(state_dict, (list, tuple)):
        items = enumerate(state_dict)
    else:
        return {}
    found = {}
    for key, value in items:
        found.update(tensor_shapes(value, f"{prefix}.{key}"))
    return found


def saved_shapes(metadata: Metadata) -> dict[str, tuple[int, ...] | None]:
    return {
        key: tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else None
        for key, meta in metadata.state_dict_metadata.items()
    }


def _differences(saved: dict, ours: dict, ours_to_load: Callable[[str], bool]) -> list[str]:
    found = []
    for key, shape in ours.items():
        if key not in saved:
            found.append(f"{key} {shape}, which it is loaded into, is not in the checkpoint")
        elif saved[key] is None:
            found.append(f"{key} is not a tensor in the checkpoint, and a tensor of shape {shape} here")
        elif saved[key] != shape:
            found.append(f"{key} has shape {saved[key]} in the checkpoint and {shape} here")
    for key, shape in saved.items():
        if shape is not None and key not in ours and ours_to_load(key):
            found.append(f"the checkpoint holds {key} {shape}, which what it is loaded into has not")
    return found


def misfit(saved: dict, ours: dict, ours_to_load: Callable[[str], bool]) -> str | None:
    found = _differences(saved, ours, ours_to_load)
    if not found:
        return None
    more = len(found) - 1
    return found[0] + (f" (and {more} more key{'s differ' if more > 1 else ' differs'})" if more else "")
