"""Which FSDP unit each collective of a final (lowered) trace gathers or reduces.

``units_of_collectives(trace, plan) -> {collective output name: (Unit, CollectiveKind)}``

1. an all-gather's unit: walk its input back through producers to the parameter shards it packs;
2. a reduce-scatter's unit: walk its result forward through consumers to the gradients the trace
   returns (position ``i`` of the backward's return is the gradient of forward argument ``i``).
"""

from __future__ import annotations

from thunder.core import utils
from thunder.core.proxies import Proxy

from fsdp_pass.op_names import ALL_GATHER, REDUCE_SCATTER
from fsdp_pass.plan.units import UnitPlan
from fsdp_pass.predicates import is_all_gather, is_reduce_scatter, is_return


def _roots(proxy, producers, stop: set[str]) -> set[str]:
    """Names of the inputs ``proxy`` is computed from (walking back no further than names in ``stop``)."""
    seen, stack, roots = set(), [proxy], set()
    while stack:
        p = stack.pop()
        if p.name in seen:
            continue
        seen.add(p.name)
        if p.name in stop:  # a shard: a forward argument, or a saved tensor unpacked in the backward
            roots.add(p.name)
            continue
        bsym = producers.get(p, None)
        args = list(bsym.flat_proxy_args) if bsym is not None else []
        if not args:
            roots.add(p.name)
        stack.extend(args)
    return roots


def _returned_positions(proxy, consumers, return_values) -> set[int]:
    """Positions of the returned values that ``proxy`` flows into."""
    position = {}
    for i, v in enumerate(return_values):
        if isinstance(v, Proxy):
            position.setdefault(v.name, set()).add(i)
    seen, stack, hits = set(), [proxy], set()
    while stack:
        p = stack.pop()
        if p.name in seen:
            continue
        seen.add(p.name)
        hits |= position.get(p.name, set())
        for bsym in consumers.get(p, []):
            if not is_return(bsym):
                stack.extend(bsym.flat_proxy_outs)
    return hits


def units_of_collectives(trace, plan: UnitPlan) -> dict:
    """Output name of each collective in ``trace`` -> (its :class:`Unit`, its :class:`CollectiveKind`), for the
    ones found."""
    param_of_arg, arg_order = plan.param_of_arg, plan.arg_order
    unit_of_param = {p: u for u in plan.units for p in u.params}
    shards = set(param_of_arg)
    producers, consumers = utils.producers(trace), utils.consumers(trace)
    (ret,) = [b for b in trace.bound_symbols if is_return(b)]
    returned = ret.args[0] if isinstance(ret.args[0], (tuple, list)) else ()

    found = {}
    for bsym in trace.bound_symbols:
        units = []
        if is_all_gather(bsym):
            params = [param_of_arg[n] for n in _roots(bsym.flat_proxy_args[0], producers, shards) if n in shards]
            units = [unit_of_param[p] for p in params if p in unit_of_param]
            kind = ALL_GATHER
        elif is_reduce_scatter(bsym):
            hits = _returned_positions(bsym.output, consumers, returned)
            params = [param_of_arg.get(arg_order[i]) for i in hits if i < len(arg_order)]
            units = [unit_of_param[p] for p in params if p in unit_of_param]
            kind = REDUCE_SCATTER
        if units:
            found[bsym.output.name] = (units[0], kind)
    return found
