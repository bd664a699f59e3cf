"""The module tree as the unit policies see it: module names, their classes and their parameter names.

Built once from the user's module (before any trace exists) and kept as plain data, so a policy can
be applied to a trace later without touching the module again. Parameter names are the full dotted
names ``named_parameters(remove_duplicate=False)`` gives, so a tied parameter has one name per place
it is registered.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch.nn as nn

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@dataclass(frozen=True)
class ModuleTree:
    classes: dict[str, type]  # module name ("" for the root) -> class, in registration order
    children: dict[str, tuple[str, ...]]  # module name -> names of its direct children
    params: dict[str, tuple[str, ...]]  # module name -> every parameter name under it
    names_of: dict[int, tuple[str, ...]]  # id(module) -> the names it is registered under

    @classmethod
    def of(cls, model: nn.Module) -> "ModuleTree":
        classes, children, params, names_of = {}, {}, {}, {}
        for name, m in model.named_modules(remove_duplicate=False):
            classes[name] = type(m)
            children[name] = tuple(_join(name, c) for c, _ in m.named_children())
            params[name] = tuple(_join(name, p) for p, _ in m.named_parameters(remove_duplicate=False))
            names_of[id(m)] = names_of.get(id(m), ()) + (name,)
        return cls(classes, children, params, names_of)

    @classmethod
    def flat(cls, param_names) -> "ModuleTree":
        """A tree with only the root: for traces whose module is not at hand."""
        return cls({"": nn.Module}, {"": ()}, {"": tuple(param_names)}, {})

    def repeated_blocks(self) -> list[str]:
        """Children of containers (ModuleList, Sequential, ModuleDict) holding 2+ modules of one class.

        The outermost such containers win: the layers of a decoder, not the heads inside a layer.
        """
        blocks: list[str] = []
        for name, klass in self.classes.items():
            if any(name == b or name.startswith(b + ".") for b in blocks):
                continue
            kids = self.children[name]
            if issubclass(klass, CONTAINERS) and len(kids) >= 2 and len({self.classes[k] for k in kids}) == 1:
                blocks.extend(k for k in kids if self.params[k])
        return blocks

    def top_level_children(self) -> list[str]:
        return [c for c in self.children[""] if self.params[c]]

    def module_of_param(self, param: str) -> str:
        return param.rpartition(".")[0]

    def outermost(self, names) -> list[str]:
        """``names`` without those nested inside another of them, in tree order."""
        chosen = set(names)
        out = []
        for n in self.classes:
            if n in chosen and not any(n.startswith(o + ".") for o in out):
                out.append(n)
        return out

    def modules_matching(self, pattern: str) -> list[str]:
        """Module names equal to ``pattern``, else matching it as a glob (``layers.*``); outermost only."""
        if pattern in self.classes:
            return [pattern]
        return self.outermost(n for n in self.classes if n and fnmatch.fnmatchcase(n, pattern))

    def instances_of(self, klass: type) -> list[str]:
        return self.outermost(n for n, c in self.classes.items() if issubclass(c, klass))
