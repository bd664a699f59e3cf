"""The original module once it is sharded: where its weights are, and getting them back for a new jit.

After :func:`~fsdp_pass.shard.module.shard_module`, the jitted module's shards are the only up-to-date copy
of the weights (the optimizer steps on them). The original module keeps meta tensors
(``release_original_parameters=True``, the default) or the full tensors it had before training.

1. :func:`remember_shards`: which jitted module holds the original module's weights is recorded beside it
   (weak references: neither keeps the other alive). When its tensors were released, calling the original
   raises an FSDPError saying where the weights are and how to get a full copy, instead of torch's error
   about meta tensors.
2. :func:`restore_from_shards`: jitting the original module with FSDP again (e.g. to change the strategy)
   first puts the current weights back into it: each parameter gathered from the holder's shards
   (collective: every rank jits again, or each that did raises within ``FSDP(timeout=...)``) with the
   shard's ``requires_grad``, and the buffers copied from the holder. So the new jit starts from the same
   weights, not from a fresh ``reset_parameters()``. When the holder is gone, released weights are gone
   with it (FSDPError); kept originals are jitted as they are.
   After a dry run (meta device) or under a fake process group there were no weights to keep: the module
   is jitted as it is (on the meta device, initialized when jitted for real, as a model built there).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from thunder.core.interpreter import is_jitting

from fsdp_pass.errors import check, fail
from fsdp_pass.shard.global_view import gather_full
from fsdp_pass.shard.module import ShardedModel


@dataclass(frozen=True)
class Holder:
    """The jitted module that holds an original module's weights."""

    jitted: weakref.ref  # to the ThunderModule (the original must not keep it, and its shards, alive)
    has_weights: bool  # False after a dry run (meta device) or under a fake group: nothing to gather back


# kept beside the user's module, not in it (its __dict__ stays picklable): keyed weakly by the original module
_holders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # -> Holder
_released: weakref.WeakSet = weakref.WeakSet()  # original modules whose parameters are meta tensors now
_guarded: weakref.WeakSet = weakref.WeakSet()  # original modules with the call guard registered

REJIT = "thunder.jit(model, transforms=[FSDP(...)]) of a module sharded before"
FULL_COPY = (
    "For a full unsharded copy, on every rank: sd = fsdp_pass.full_state_dict(jm) (or "
    "fsdp_pass.get_model_state_dict(jm, options=StateDictOptions(full_state_dict=True))), then build a fresh "
    "model and fresh.load_state_dict(sd)."
)


def remember_shards(thunder_module, sharded: ShardedModel, released: bool) -> None:
    """Record which jitted module holds the original module's weights; guard calls while ``released``."""
    original = thunder_module._model
    real = sharded.placed_on.type != "meta" and dist.get_backend(sharded.group) != "fake"
    _holders[original] = Holder(weakref.ref(thunder_module), has_weights=real)
    if released:
        _released.add(original)
    else:
        _released.discard(original)
    if released and original not in _guarded:
        original.register_forward_pre_hook(_refuse_released_call)
        _guarded.add(original)


def _refuse_released_call(module, args) -> None:
    """Forward pre-hook of a sharded original module: calling it eagerly while its tensors are meta is an
    FSDPError. Thunder traces the original's forward when the jitted module compiles: no error there."""
    if is_jitting() or module not in _released:
        return
    fail(
        f"This {type(module).__name__} was sharded by thunder.jit(..., transforms=[fsdp_pass.FSDP(...)]): its "
        "weights live in the jitted module's shards (each rank holds 1/N of every parameter) and its own "
        "parameters were released (meta tensors, release_original_parameters=True), so it cannot be called.",
        f"Call the jitted module (jm = thunder.jit(model, ...); jm(x)) instead. {FULL_COPY}",
    )


def restore_from_shards(thunder_module) -> None:
    """Put the current weights back into the module being jitted, if an earlier FSDP jit holds them."""
    original = thunder_module._model
    record = _holders.get(original)
    if record is None or not record.has_weights:  # never sharded, or its weights never existed here
        return
    holder = record.jitted()
    fsdp = None if holder is None else _fsdp_of(holder)
    released = original in _released
    if fsdp is None:
        check(
            not released,
            f"This {type(original).__name__} was sharded by an earlier thunder.jit with fsdp_pass.FSDP, which "
            "released its parameters (meta tensors), and that jitted module has since been deleted: the "
            "weights were in its shards and are gone.",
            "Keep the jitted module alive until the module is jitted again (the new jit starts from its "
            "weights), or save them first (fsdp_pass.full_state_dict(jm) or fsdp_pass.save_checkpoint) and "
            "load them into a freshly built model.",
        )
        return  # the original kept its own full tensors (release_original_parameters=False): jit those
    # collective: a rank that does not jit again makes the others raise within the timeout, not hang
    fsdp.arrive(REJIT)
    with torch.no_grad():
        _restore_parameters(original, holder, fsdp.model)
        _restore_buffers(original, holder)
    _released.discard(original)
    # the ThunderModule listed the original's (meta) tensors when it was made: point it at the restored ones
    thunder_module._overrides_parameters.update(original.named_parameters(remove_duplicate=False))
    thunder_module._overrides_buffers.update(original.named_buffers(remove_duplicate=False))


def _fsdp_of(holder):
    """The holder's FSDP transform (None if its thunder.jit failed before the transform was recorded)."""
    for t in getattr(holder, "_lc_transforms", ()):
        if isinstance(getattr(t, "model", None), ShardedModel):
            return t
    return None


def _restore_parameters(original, holder, sharded: ShardedModel) -> None:
    """Each parameter name of ``original`` gets the full tensor gathered from ``holder``'s shard (tied names
    one tensor), on the compute device, with the shard's current ``requires_grad``."""
    full: dict[str, torch.nn.Parameter] = {}
    for spec in sharded.sharding.params:
        if spec.shard_of not in full:
            shard = holder.get_parameter(spec.shard_of)
            value = gather_full(shard.detach().to(sharded.device), spec.layout, sharded.group)
            full[spec.shard_of] = torch.nn.Parameter(value.clone(), requires_grad=shard.requires_grad)
        _set_parameter(original, spec.name, full[spec.shard_of])


def _restore_buffers(original, holder) -> None:
    """Each buffer of ``original`` becomes a copy of ``holder``'s (it may have moved it, or updated it)."""
    copies: dict[int, torch.Tensor] = {}
    for name, _ in list(original.named_buffers(remove_duplicate=False)):
        current = holder.get_buffer(name)
        if id(current) not in copies:
            copies[id(current)] = current.detach().clone()
        _set_buffer(original, name, copies[id(current)])


def _owner(module, name: str) -> tuple[torch.nn.Module, str]:
    mod_name, _, attr = name.rpartition(".")
    return module.get_submodule(mod_name), attr


def _set_parameter(module, name: str, value: torch.nn.Parameter) -> None:
    sub, attr = _owner(module, name)
    sub.register_parameter(attr, value)


def _set_buffer(module, name: str, value: torch.Tensor) -> None:
    sub, attr = _owner(module, name)
    sub._buffers[attr] = value  # in place of the old one: stays persistent or not
