"""The ops that belong to a collective in a trace: those that build its send buffer, and those that take
its result apart after the wait.

``packing_group(c, ...)``: collective ``c`` and the packing ops (shapes, ``cat``, ``pad``, casts, divisions)
whose results flow only into it. ``unpacking_group(w, ...)``: wait ``w`` and the packing ops reading only
what it returns (cutting a gathered buffer into parameters; dividing, casting, copying a reduced shard).
The scheduling pass moves these groups with their collective; the overlap report does not count the
unpacking ops as compute that hides a collective. ``gathered_parameters(trace)``: the names that hold gathered
parameters in a final trace (what its all-gathers' unpacking groups make); ``first_reader(bsyms, names)``: the
first op that computes with any of them.
"""

from __future__ import annotations

from fsdp_pass.predicates import is_all_gather, is_bookkeeping, is_packing, is_wait


def graph(bsyms):
    """producer index of each proxy name, and the sorted consumer indices of each proxy name."""
    producer, consumers = {}, {}
    for i, b in enumerate(bsyms):
        for p in b.flat_proxy_outs:
            producer.setdefault(p.name, i)
        for p in b.flat_proxy_args:
            consumers.setdefault(p.name, []).append(i)
    return producer, consumers


def packing_group(c: int, bsyms, producer, consumers) -> list[int]:
    """``c`` and the packing ops whose results flow only into it (walking back from its input)."""
    group, stack = {c}, [c]
    while stack:
        for p in bsyms[stack.pop()].flat_proxy_args:
            j = producer.get(p.name)
            if j is None or j in group or not is_packing(bsyms[j]):
                continue
            if all(k in group for o in bsyms[j].flat_proxy_outs for k in consumers.get(o.name, [])):
                group.add(j)
                stack.append(j)
    return sorted(group)


def unpacking_group(w: int, bsyms, consumers) -> tuple[list[int], list[int], set[str]]:
    """``w`` and the packing ops reading only what it returns (transitively), the other readers, and
    the names of everything the group makes."""
    group, made_here, stack, readers = {w}, {o.name for o in bsyms[w].flat_proxy_outs}, [w], set()
    while stack:
        for o in bsyms[stack.pop()].flat_proxy_outs:
            for j in consumers.get(o.name, []):
                if j in group:
                    continue
                if is_packing(bsyms[j]) and all(p.name in made_here for p in bsyms[j].flat_proxy_args):
                    group.add(j)
                    made_here.update(q.name for q in bsyms[j].flat_proxy_outs)
                    stack.append(j)
                else:
                    readers.add(j)
    return sorted(group), sorted(readers - group), made_here


def gathered_parameters(trace) -> frozenset[str]:
    """The names holding gathered parameters in ``trace`` (a final forward): each all-gather's wait result and
    what the ops cutting it up make. Those the forward returns are the parameters of the units it keeps
    gathered, which the backward receives under the same names."""
    bsyms = trace.bound_symbols
    _, consumers = graph(bsyms)
    gathers = {b.output.name for b in bsyms if is_all_gather(b)}
    names: set[str] = set()
    for w, b in enumerate(bsyms):
        if is_wait(b) and b.args[0].name in gathers:
            names |= unpacking_group(w, bsyms, consumers)[2]
    return frozenset(names)


def first_reader(bsyms, names) -> int | None:
    """Index of the first op of ``bsyms`` that computes with any of ``names``, through the packing ops (views,
    re-layouts, casts) that only re-present them (lines that manage names and lifetimes do not count); None if
    none does."""
    aliases = set(names)
    for i, b in enumerate(bsyms):
        if not is_bookkeeping(b) and any(p.name in aliases for p in b.flat_proxy_args):
            if not is_packing(b):
                return i
            aliases.update(o.name for o in b.flat_proxy_outs)
    return None
