"""``requires_grad`` changed after ``thunder.jit``: the next call compiles a variant with the new flags.

Thunder traces the *original* module's tensors (the shards replace them only when the step runs), so a
parameter frozen on the jitted module after it compiled (``p.requires_grad_(False)``) would be traced as
trainable again, and Thunder's prologue would stop the step with a bare AssertionError.

:func:`follow_requires_grad` registers a forward pre-hook on the jitted module. Before each call it compares
every sharded tensor's ``requires_grad``, on its shard and on the original module's tensor, with the
sharding plan's. When either changed:

1. while :func:`fsdp_pass.no_sync` holds accumulated gradients, FSDPError (their per-unit buffers would
   change layout mid-accumulation);
2. the new flag is set on the shard and on the original module's tensor (tied names share both);
3. the transform's :class:`~fsdp_pass.shard.module.ShardedModel` is replaced by one whose plan carries the
   new flags (the next unit plan, ``explain()`` and the gradient norms read it).

Thunder's cached prologue then fails its ``requires_grad`` check and Thunder compiles a variant traced from
the new flags, as for a model frozen before jitting: a frozen parameter is gathered, never reduce-scattered,
and gets no gradient; the others get the gradients they would get unsharded.
"""

from __future__ import annotations

from dataclasses import replace

from fsdp_pass.errors import check
from fsdp_pass.shard.module import ShardedModel


def follow_requires_grad(thunder_module, fsdp) -> None:
    """``fsdp``: the FSDP transform of ``thunder_module`` (its ``model`` and ``accumulators``)."""
    places = tensor_places(thunder_module, fsdp.model)

    def before_call(module, args) -> None:
        flags = changed_flags(fsdp.model, places)
        if flags:
            fsdp.model = apply_flags(thunder_module, fsdp.model, flags, fsdp.accumulators)

    thunder_module.register_forward_pre_hook(before_call)


def tensor_places(thunder_module, sharded: ShardedModel) -> list[tuple[str, dict, dict, str]]:
    """Per sharded tensor: (name, the dict holding its shard, the dict holding the original's tensor, key
    there), so the check before each call reads two dicts per tensor instead of walking the module tree."""
    places = []
    for spec in sharded.sharding.owners():
        mod_name, _, attr = spec.name.rpartition(".")
        owner = thunder_module._model.get_submodule(mod_name)
        places.append((spec.name, thunder_module._overrides_parameters, owner._parameters, attr))
    return places


def changed_flags(sharded: ShardedModel, places) -> dict[str, bool]:
    """Owner name -> new ``requires_grad``, for each sharded tensor whose flag differs from the plan's."""
    changed, plan = {}, sharded.sharding
    for name, shards, originals, attr in places:
        planned = plan.param(name).requires_grad
        if shards[name].requires_grad != planned or originals[attr].requires_grad != planned:
            changed[name] = not planned
    return changed


def apply_flags(thunder_module, sharded: ShardedModel, flags: dict[str, bool], accumulators) -> ShardedModel:
    """Set ``flags`` on the shards and the original's tensors; the ShardedModel whose plan carries them."""
    check(
        not accumulators.pending,
        lambda: f"requires_grad of {sorted(flags)} changed while no_sync() holds accumulated gradients of "
        f"{len(accumulators.pending)} unit(s).",
        "Set it back to finish this accumulation (the next backward outside no_sync() reduces it), and change "
        "requires_grad between optimizer steps: after optimizer.step(), before the next micro-batch.",
    )
    original = thunder_module._model
    for name, requires_grad in flags.items():
        thunder_module.get_parameter(name).requires_grad_(requires_grad)
        original.get_parameter(name).requires_grad_(requires_grad)
    specs = tuple(
        replace(s, requires_grad=flags[s.shard_of]) if s.shard_of in flags else s for s in sharded.sharding.params
    )
    return replace(sharded, sharding=replace(sharded.sharding, params=specs))
