"""The step's inputs, checked where they enter: each mistake an ``FSDPError`` naming the argument, before the compile.

A jitted model's call runs Thunder's cache lookup, and on a miss traces the module (seconds), then derives the
backward, lowers and compiles (20-90 s for a Hugging Face model). What is wrong with an input is caught as early as
it can be known:

1. Before the compiled step, at every call (no trace needed, a few microseconds: the tensors are named only when
   one is misplaced): :func:`check_input_devices`. An input
   on the meta device holds no values (Thunder would compile for it and copy nothing, or fail at run time); an input
   on another device than the one the step computes on (the shards' compute device) would be compiled for, then
   fail or copy at every step. A 0-d CPU tensor beside CUDA compute is allowed, as torch allows it.
2. While Thunder traces the step (before any autodiff or compile): :func:`explain_trace_failure`. When tracing
   fails, the inputs that explain it are named: a floating input in another dtype than the model computes in, when
   no mixed precision casts it (a float64 ``inputs_embeds`` for float32 weights: "Expected a.dtype=float64 and
   w.dtype=float32 to be the same"), and a floating input holding whole numbers only, as token ids do ("index
   dtype=float32 was not an integer dtype"). The failure is not ours to guess past what the inputs show: with no
   such input, Thunder's own error goes up unchanged.
3. Once traced, before the backward is derived: :mod:`fsdp_pass.shard.index_inputs` (an integer input that the
   trace uses where torch needs int64 indices).

Every input tensor, at any depth of lists, tuples and dicts, is named as its user knows it (:func:`argument_label`):
``argument 0 (idx)``, ``keyword argument input_ids``, ``keyword argument batch['x'][1]``.
"""

from __future__ import annotations

import inspect

import torch
from torch.utils._pytree import MappingKey, SequenceKey, tree_flatten_with_path, tree_leaves

from fsdp_pass.errors import FSDPError, check


def positional_names(module) -> tuple[str, ...]:
    """The names of ``module.forward``'s positional parameters (empty where its signature cannot be read)."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in parameters if p.kind in kinds)


def argument_label(root: str, keys: list, names: tuple[str, ...] = ()) -> str:
    """``root`` ``"args"`` or ``"kwargs"`` and the keys below it -> ``argument 0 (idx)``, ``keyword argument
    batch['x'][1]``."""
    first, rest = keys[0], "".join(f"[{k!r}]" for k in keys[1:])
    if root == "kwargs":
        return f"keyword argument {first}{rest}"
    name = f" ({names[first]}{rest})" if isinstance(first, int) and first < len(names) else rest
    return f"argument {first}{name}"


def _key(entry):
    return entry.idx if isinstance(entry, SequenceKey) else entry.key if isinstance(entry, MappingKey) else str(entry)


def named_tensors(args: tuple, kwargs: dict, names: tuple[str, ...] = ()) -> list[tuple[str, torch.Tensor]]:
    """Every tensor among a call's inputs, with its :func:`argument_label`."""
    out = []
    for root, tree in (("args", tuple(args)), ("kwargs", dict(kwargs))):
        leaves, _ = tree_flatten_with_path(tree)
        out += [(argument_label(root, [_key(k) for k in path], names), leaf)
                for path, leaf in leaves if isinstance(leaf, torch.Tensor)]
    return out


def _same_device(t: torch.Tensor, device: torch.device) -> bool:
    if t.device == device or (t.device.type == device.type and device.index is None):
        return True
    return t.dim() == 0 and t.device.type == "cpu" and device.type != "meta"  # torch's rule for 0-d CPU tensors


def _input_tensors(args: tuple, kwargs: dict):
    """Every tensor among a call's inputs, in :func:`named_tensors`' order, without naming them (the per-call path:
    a direct loop over the common flat arguments, pytree only for nested ones)."""
    for tree in (args, kwargs.values()):
        for x in tree:
            if isinstance(x, torch.Tensor):
                yield x
            elif isinstance(x, (list, tuple, dict)):
                yield from (leaf for leaf in tree_leaves(x) if isinstance(leaf, torch.Tensor))


def _misplaced(t: torch.Tensor, device: torch.device) -> bool:
    return (t.is_meta and device.type != "meta") or not _same_device(t, device)


def check_input_devices(args: tuple, kwargs: dict, device, names: tuple[str, ...] = ()) -> None:
    """Step 1: every input tensor of the call ``(args, kwargs)`` is on ``device``, where the step computes (None:
    not known, nothing checked). At every call: the tensors are named (:func:`named_tensors`) only when one is
    not where it should be."""
    if device is None:
        return
    device = torch.device(device)
    if not any(_misplaced(t, device) for t in _input_tensors(args, kwargs)):
        return
    for label, t in named_tensors(args, kwargs, names):
        check(
            not t.is_meta or device.type == "meta",
            f"The model's {label} is on the meta device: it has a shape and a dtype but no values, and the step "
            f"computes on {device}.",
            f"Pass real values on {device} (a meta tensor is what a model built under `with torch.device('meta')` "
            "or a dry run holds; for a dry run use fsdp_pass.report.dry_run, which traces without running).",
        )
        check(
            _same_device(t, device),
            f"The model's {label} is on {t.device}, and the step computes on {device} (where its shards are "
            "gathered to).",
            f"Move it there first: .to({str(device)!r}) (a batch from a DataLoader: move each tensor, "
            "e.g. {k: v.to(device) for k, v in batch.items()}).",
        )


def _whole_numbers(t: torch.Tensor) -> tuple[int, int] | None:
    """(smallest, largest) when the floating ``t`` holds only whole numbers, not all 0 and 1 (a mask), else None."""
    if t.numel() == 0 or t.is_meta:
        return None
    flat = t.detach().reshape(-1)
    if not bool(torch.isfinite(flat).all()) or not bool((flat == flat.round()).all()):
        return None
    low, high = int(flat.min()), int(flat.max())
    return (low, high) if low >= 0 and high > 1 else None


DTYPE_FIX = (
    "Pass floating inputs in the dtype the model computes in (x.to(dtype)), or let "
    "FSDP(mixed_precision=MixedPrecision(param_dtype=...)) cast them."
)
IDS_FIX = "Pass token ids as an integer tensor: ids.long() (int32 works too)."


def input_findings(named, compute_dtype: torch.dtype | None) -> list[tuple[str, str]]:
    """What the inputs show that explains a failed trace, as (finding, fix): per floating input in another dtype
    than ``compute_dtype`` (None: the model's dtypes are mixed, nothing to say), or holding whole numbers only."""
    found = []
    for label, t in named:
        if not t.is_floating_point():
            continue
        name = str(t.dtype).removeprefix("torch.")
        if compute_dtype is not None and t.dtype != compute_dtype:
            found.append((
                f"{label} is {name}, and the model computes in {str(compute_dtype).removeprefix('torch.')} (its "
                "floating parameters); no mixed precision casts it", DTYPE_FIX))
            continue
        ids = _whole_numbers(t)
        if ids is not None:
            found.append((f"{label} is {name} and holds whole numbers only ({ids[0]} to {ids[1]}), as token ids do: "
                          "an embedding or an index takes integer ids", IDS_FIX))
    return found


def explain_trace_failure(error: Exception, named, compute_dtype: torch.dtype | None) -> FSDPError | None:
    """Step 2: an FSDPError naming the inputs that explain ``error`` (raised while Thunder traced the step), or None
    when they show nothing (then ``error`` is the user's to read as it is)."""
    if isinstance(error, FSDPError):
        return None
    found = input_findings(named, compute_dtype)
    if not found:
        return None
    text = str(error).strip()
    first_line = text.splitlines()[0] if text else ""
    lines = [f"Thunder could not trace the model's step ({type(error).__name__}: {first_line}).",
             *(f"  {finding}." for finding, _ in found)]
    fixes = " ".join(dict.fromkeys(fix for _, fix in found))
    return FSDPError("\n".join(lines) + f"\n  What to do: {fixes}")
