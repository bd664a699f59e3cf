"""Unit policies: which parameters travel together (one all-gather, one reduce-scatter per unit).

A policy sees the module tree and where the forward trace uses each parameter, and returns groups
of parameter names. Four are provided:

- :class:`Blocks` (the default): one unit per repeated block (each child of a ``ModuleList`` or
  ``Sequential`` of 2+ modules of one class, e.g. the decoder layers); every other parameter is
  grouped with its neighbours *in the trace*: those first used before the first block form one unit
  (the embedding), those first used after the last block another (final norm and head), and so on
  for each gap. So no unit spans both ends of the program, unlike a module-tree "root unit".
  A model without repeated blocks gets one unit per top-level child module.
- :class:`Groups`: explicit units. Each item is a module, a module class (one unit per instance),
  a module name or glob (``"layers.*"``: one unit per match), or a list of those (one unit, even
  of modules far apart, e.g. ``[model.norm, model.lm_head]``). Parameters no item claims follow
  :class:`Blocks`: the repeated blocks' units, the rest grouped by trace position.
- :class:`BySize`: another policy's units, consecutive ones merged while the merged unit stays
  within a byte budget (unsharded bytes).
- :class:`PerParameter`: every parameter its own unit (what Thunder's FSDP does), for comparison.

``units=`` on :class:`~fsdp_pass.FSDP` takes one of these, ``"blocks"``, ``"per_parameter"``, or a
list (read as :class:`Groups`).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch.nn as nn

from fsdp_pass.errors import check, fail
from fsdp_pass.plan.module_tree import ModuleTree

Group = tuple[str, tuple[str, ...]]  # (unit name, parameter names)


@dataclass(frozen=True)
class PolicyInput:
    tree: ModuleTree
    order: tuple[str, ...]  # parameter names the forward reads, in order of first use
    first_use: dict[str, int]
    nbytes: dict[str, int]  # unsharded bytes of each parameter


def _joined(names, counted: str = "") -> str:
    """``a+b+c``, or ``a+b+...(N counted)`` for more than three names."""
    if len(names) <= 3:
        return "+".join(names)
    return f"{'+'.join(names[:2])}+...({len(names)}{' ' + counted if counted else ''})"


def _unit_name(tree: ModuleTree, params) -> str:
    """A readable name for a group of parameters: their modules, joined with '+'."""
    mods: list[str] = []
    for p in params:
        m = tree.module_of_param(p) or p
        if m not in mods:
            mods.append(m)
    return _joined(mods, "modules")


def _unique(groups: list[Group]) -> list[Group]:
    seen: dict[str, int] = {}
    out = []
    for name, params in groups:
        seen[name] = seen.get(name, 0) + 1
        out.append((name if seen[name] == 1 else f"{name}#{seen[name]}", params))
    return out


def group_the_rest_by_position(anchors: list[Group], inp: PolicyInput) -> list[Group]:
    """Add units for the parameters no anchor claims: one per gap between anchors, by first use."""
    claimed = {p for _, ps in anchors for p in ps}
    anchor_starts = sorted(min(inp.first_use[p] for p in ps) for _, ps in anchors if ps)
    gaps: dict[int, list[str]] = {}
    for p in inp.order:
        if p not in claimed:
            gap = sum(1 for s in anchor_starts if s < inp.first_use[p])
            gaps.setdefault(gap, []).append(p)
    rest = [(_unit_name(inp.tree, ps), tuple(ps)) for _, ps in sorted(gaps.items())]
    return _unique([g for g in anchors if g[1]] + rest)


def _used(params, inp: PolicyInput) -> tuple[str, ...]:
    return tuple(p for p in params if p in inp.first_use)


class Blocks:
    """One unit per repeated block; the rest grouped by where the trace first uses them."""

    name = "blocks"

    def groups(self, inp: PolicyInput) -> list[Group]:
        blocks = inp.tree.repeated_blocks() or inp.tree.top_level_children()
        return group_the_rest_by_position([(b, _used(inp.tree.params[b], inp)) for b in blocks], inp)


class PerParameter:
    """Every parameter its own unit: one collective per parameter."""

    name = "per_parameter"

    def groups(self, inp: PolicyInput) -> list[Group]:
        return [(p, (p,)) for p in inp.order]


class Groups:
    """Explicit units: modules, module classes, module names or globs, or lists of those."""

    name = "groups"

    def __init__(self, *items):
        check(bool(items), "Groups() needs at least one item.", "Pass modules, classes, names or lists of them.")
        self.items = items

    def _resolve(self, item, tree: ModuleTree) -> list[list[str]]:
        """Module names for ``item``: a list of units, each a list of module (or parameter) names."""
        if isinstance(item, nn.Module):
            names = tree.names_of.get(id(item), ())
            check(bool(names), f"Unit item {type(item).__name__} is not a submodule of the model.",
                  "Pass submodules of the module given to thunder.jit (or their names).")
            return [[names[0]]]
        if isinstance(item, type) and issubclass(item, nn.Module):
            found = tree.instances_of(item)
            check(bool(found), f"No submodule of class {item.__name__} in the model.",
                  "Check the class, or name the modules instead.")
            return [[n] for n in found]
        if isinstance(item, str):
            found = tree.modules_matching(item)
            if not found:
                params = [p for p in tree.params[""] if p == item or fnmatch.fnmatchcase(p, item)]
                check(bool(params), f"Unit item {item!r} matches no module or parameter name.",
                      f"Module names look like {[n for n in tree.classes if n][:4]}.")
                return [params]
            return [[n] for n in found]
        if isinstance(item, (list, tuple)):
            return [[n for sub in item for unit in self._resolve(sub, tree) for n in unit]]
        fail(f"Cannot read {item!r} as a unit.", "Use a module, a module class, a name or glob, or a list of those.")

    def groups(self, inp: PolicyInput) -> list[Group]:
        tree = inp.tree
        owner: dict[str, str] = {}
        anchors: list[Group] = []
        for item in self.items:
            for names in self._resolve(item, tree):
                params = [p for n in names for p in (tree.params.get(n) or (n,))]
                label = _joined(names)
                for p in params:
                    check(p not in owner, f"Parameter {p!r} is in two units: {owner.get(p)!r} and {label!r}.",
                          "Give every parameter at most one unit.")
                    owner[p] = label
                anchors.append((label, _used(params, inp)))
        # what the items leave alone follows the default: repeated blocks, then the rest by position
        for block in tree.repeated_blocks():
            free = tuple(p for p in _used(tree.params[block], inp) if p not in owner)
            owner.update(dict.fromkeys(free, block))
            anchors.append((block, free))
        return group_the_rest_by_position(anchors, inp)


class BySize:
    """Another policy's units, consecutive ones merged up to ``max_bytes`` unsharded bytes per unit."""

    name = "by_size"

    def __init__(self, max_bytes: int, base="blocks"):
        check(isinstance(max_bytes, int) and max_bytes > 0, f"BySize needs a positive byte budget, got {max_bytes!r}.",
              "e.g. BySize(25 * 2**20) for 25 MiB units.")
        self.max_bytes = max_bytes
        self.base = resolve_policy(base)

    def groups(self, inp: PolicyInput) -> list[Group]:
        base = sorted(self.base.groups(inp), key=lambda g: min(inp.first_use[p] for p in g[1]))
        merged: list[tuple[list[str], list[str]]] = []  # (names, params)
        size = 0
        for name, params in base:
            b = sum(inp.nbytes[p] for p in params)
            if merged and size + b <= self.max_bytes:
                merged[-1][0].append(name)
                merged[-1][1].extend(params)
                size += b
            else:
                merged.append(([name], list(params)))
                size = b
        return _unique([(n[0] if len(n) == 1 else f"{n[0]}..{n[-1]}", tuple(ps)) for n, ps in merged])


POLICIES = {"blocks": Blocks, "per_parameter": PerParameter}


class StepModelUnits:
    """``units=`` left out: the step model chooses the units at the first compile
    (:mod:`fsdp_pass.search.default_units`), from these cost inputs and budget once settled
    (:func:`~fsdp_pass.search.default_units.settled_units`). Without a step summary (the functional path), one unit
    per block."""

    name = "step_model"

    def __init__(self, cost=None, budget: int | None = None, settled: bool = False):
        self.cost, self.budget, self.is_settled = cost, budget, settled

    def groups(self, inp: PolicyInput) -> list[Group]:
        return Blocks().groups(inp)


class ChosenUnits:
    """The units the step model chose, as a unit policy: ``groups``, (unit name, parameter names) per unit in
    forward order (a :class:`~fsdp_pass.search.default_units.UnitsChoice`'s)."""

    name = "step_model"

    def __init__(self, groups):
        self.chosen = tuple(groups)

    def groups(self, inp: PolicyInput) -> list[Group]:
        used = [(n, tuple(p for p in ps if p in inp.first_use)) for n, ps in self.chosen]
        return [(n, ps) for n, ps in used if ps]


def resolve_policy(spec):
    """``"blocks"``, ``"per_parameter"``, a list of unit items, or a policy object -> a policy object."""
    if isinstance(spec, str):
        check(spec in POLICIES, f"Unknown unit policy {spec!r}.",
              f"Use one of {sorted(POLICIES)}, a list of modules/names (explicit units), or fsdp_pass.BySize(bytes).")
        return POLICIES[spec]()
    if isinstance(spec, (list, tuple)):
        return Groups(*spec)
    check(hasattr(spec, "groups"), f"Cannot use {spec!r} as a unit policy.",
          "Pass 'blocks', 'per_parameter', a list of modules/names, or a policy such as fsdp_pass.BySize(bytes).")
    return spec
