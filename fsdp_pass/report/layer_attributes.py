"""What the dry run's copied layers must share with the layer they copy: the attribute values its trace depends on.

Thunder's prologue guards a trace with the values of the module attributes the interpreter read while tracing it
(a norm's ``eps``, ``training``, a Hugging Face layer's ``attention_type`` or ``sliding_window``): the trace is the
step of any module whose attributes pass those checks. A dry run interprets a few layers of a stack and copies one
layer's ops for the others (:mod:`fsdp_pass.report.repeated_layers`), which is right only where each copied layer
would pass the checks of the layer it copies. Models whose layers alternate (sliding-window and full attention
every other layer, one global layer in six) fail here, and are interpreted whole.

``differing_attribute(prologue, layers, prefix, compared, copies) -> str | None``:

1. the reads: the prologue's checks of values reached from a submodule of a compared layer (``get_submodule`` of
   a name in it, then attributes and constant items), as paths (the submodule's name in the layer, the steps);
2. each copied layer's value at each path of the copied layer must be that layer's (the same type, equal; a
   tensor: the same shape and dtype);
3. except a value that is the layer's own position in the stack in both compared layers (transformers'
   ``layer_idx``): in a copy it must be the copy's position.

It returns a sentence naming the first value that differs, None when every copied layer agrees.
"""

from __future__ import annotations

import torch
from torch import nn

from fsdp_pass.predicates import is_prologue_value_check, is_unpack_attr, is_unpack_getitem, is_unpack_submodule

_MISSING = object()


def differing_attribute(prologue, layers: dict[str, nn.Module], prefix: str, compared: tuple[str, str],
                        copies: list[str]) -> str | None:
    """None if every layer of ``copies`` has the values the prologue checks on the compared layers' second (see the
    module's docstring); else which value differs. ``layers``: the stack's layers by key, ``prefix``: its qualified
    name and a dot."""
    position = {key: i for i, key in enumerate(layers)}
    reads = _checked_reads(prologue, prefix, compared)
    model = compared[1]
    for path in reads[model]:
        expected = _value_at(layers[model], path)
        as_position = all(_is_position(_value_at(layers[k], path), position[k]) for k in compared)
        for key in copies:
            got = _value_at(layers[key], path)
            if not (_is_position(got, position[key]) if as_position else _same(got, expected)):
                return f"{prefix}{key}{_printed(path)} is {_shown(got)}, traced as {_shown(expected)} in layer {model}"
    return None


def _checked_reads(prologue, prefix: str, compared: tuple[str, str]) -> dict[str, list[tuple]]:
    """Per compared layer, the paths ``(submodule name in the layer, steps)`` of the values the prologue checks."""
    origin: dict[str, tuple[str, str, tuple]] = {}  # a proxy's name -> (layer key, submodule name, steps)
    reads: dict[str, list[tuple]] = {key: [] for key in compared}
    for b in prologue.bound_symbols:
        if is_unpack_submodule(b):
            key, _, inner = b.args[1][len(prefix):].partition(".")
            if b.args[1].startswith(prefix) and key in compared:
                origin[b.output.name] = (key, inner, ())
        elif (is_unpack_attr(b) or is_unpack_getitem(b)) and getattr(b.args[0], "name", None) in origin:
            key, inner, steps = origin[b.args[0].name]
            origin[b.output.name] = (key, inner, steps + (("attr" if is_unpack_attr(b) else "item", b.args[1]),))
        elif is_prologue_value_check(b) and getattr(b.args[0], "name", None) in origin:
            key, inner, steps = origin[b.args[0].name]
            if (inner, steps) not in reads[key]:
                reads[key].append((inner, steps))
    return reads


def _value_at(layer: nn.Module, path: tuple):
    inner, steps = path
    try:
        value = layer.get_submodule(inner) if inner else layer
        for kind, name in steps:
            value = getattr(value, name) if kind == "attr" else value[name]
    except (AttributeError, KeyError, IndexError, TypeError):
        return _MISSING
    return value


def _is_position(value, position: int) -> bool:
    return type(value) is int and value == position


def _same(a, b) -> bool:
    if a is b:
        return True
    if type(a) is not type(b) or a is _MISSING or b is _MISSING:
        return False
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return False


def _printed(path: tuple) -> str:
    inner, steps = path
    text = f".{inner}" if inner else ""
    return text + "".join(f".{name}" if kind == "attr" else f"[{name!r}]" for kind, name in steps)


def _shown(value) -> str:
    return "missing" if value is _MISSING else repr(value)
