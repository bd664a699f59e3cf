"""State dicts of a sharded model and its optimizers, with the signatures, keys and options of
``torch.distributed.checkpoint.state_dict`` (``StateDictOptions``). Collective: every rank calls each.

``get_state_dict(jm, optimizers, *, options=None) -> (model_state_dict, optim_state_dict)``
``set_state_dict(jm, optimizers, *, model_state_dict, optim_state_dict, options=None)``
and the halves ``get_model_state_dict`` / ``set_model_state_dict`` / ``get_optimizer_state_dict`` /
``set_optimizer_state_dict``.

- Keys: the original module's names (tied names included); the optimizer's state and param groups keyed
  by parameter name (a tied parameter under its first name). ``optimizers``: one or a list.
- Values, by default: DTensors ``Shard(0)`` on the FSDP group's mesh, views of the shards, so
  ``torch.distributed.checkpoint.save`` / ``load`` write and read them at any world size.
- ``StateDictOptions(full_state_dict=True)``: full tensors, gathered (with ``cpu_offload=True``: on the
  CPU and on rank 0 only); to set one, every rank passes it, or only rank 0 with ``broadcast_from_rank0``.
  ``ignore_frozen_params``, ``strict`` and ``flatten_optimizer_state_dict`` mean what they mean in torch.
- A state dict of the other form, a missing or unexpected key, or a shape that fits neither layout: an
  FSDPError on every rank naming the key, the shape expected and the shape found.

The model side is :mod:`fsdp_pass.shard.state_dict`, the optimizer side :mod:`.optimizer_state`.
"""

from __future__ import annotations

from torch.distributed.checkpoint.state_dict import StateDictOptions

from fsdp_pass.api import arrived, fsdp_of
from fsdp_pass.errors import check
from fsdp_pass.shard import state_dict as model_side
from fsdp_pass.train import optimizer_state as optim_side
from fsdp_pass.train.optimizer_state import GROUPS, PARAMS, STATE, as_list


def _options(options: StateDictOptions | None) -> StateDictOptions:
    options = StateDictOptions() if options is None else options
    check(
        isinstance(options, StateDictOptions),
        lambda: f"options is a {type(options).__name__}, not a StateDictOptions.",
        "Pass torch.distributed.checkpoint.state_dict.StateDictOptions(...).",
    )
    check(
        not options.broadcast_from_rank0 or options.full_state_dict,
        "broadcast_from_rank0=True sends rank 0's full state dict to the other ranks, and full_state_dict is False.",
        "Pass StateDictOptions(full_state_dict=True, broadcast_from_rank0=True) with the full state dict on rank 0.",
    )
    return options


def _form(options: StateDictOptions) -> str:
    return "full" if options.full_state_dict else "sharded"


def get_model_state_dict(jm, *, options: StateDictOptions | None = None) -> dict:
    options = _options(options)
    return model_side.model_state_dict(
        jm,
        arrived(jm, "get_model_state_dict()").model,
        full=options.full_state_dict,
        cpu_offload=options.cpu_offload,
        ignore_frozen=options.ignore_frozen_params,
    )


def get_optimizer_state_dict(jm, optimizers, *, options: StateDictOptions | None = None) -> dict:
    options = _options(options)
    sharded = arrived(jm, "get_optimizer_state_dict()").model
    osd = optim_side.optimizer_state_dict(
        jm, sharded, optimizers, full=options.full_state_dict, cpu_offload=options.cpu_offload
    )
    return flatten(osd) if options.flatten_optimizer_state_dict and osd else osd


def get_state_dict(jm, optimizers, *, options: StateDictOptions | None = None) -> tuple[dict, dict]:
    return get_model_state_dict(jm, options=options), get_optimizer_state_dict(jm, optimizers, options=options)


def set_model_state_dict(jm, model_state_dict: dict, *, options: StateDictOptions | None = None) -> None:
    options = _options(options)
    model_side.load_model_state_dict(
        jm,
        arrived(jm, "set_model_state_dict()").model,
        model_state_dict,
        form=_form(options),
        strict=options.strict,
        ignore_frozen=options.ignore_frozen_params,
        broadcast=options.broadcast_from_rank0,
    )


def set_optimizer_state_dict(
    jm, optimizers, optim_state_dict: dict, *, options: StateDictOptions | None = None
) -> None:
    options = _options(options)
    if options.flatten_optimizer_state_dict and optim_state_dict:
        optim_state_dict = unflatten(optim_state_dict, jm, optimizers)
    optim_side.load_optimizer_state_dict(
        jm,
        arrived(jm, "set_optimizer_state_dict()").model,
        optimizers,
        optim_state_dict,
        form=_form(options),
        broadcast=options.broadcast_from_rank0,
    )


def set_state_dict(
    jm, optimizers, *, model_state_dict: dict, optim_state_dict: dict, options: StateDictOptions | None = None
) -> None:
    set_model_state_dict(jm, model_state_dict, options=options)
    set_optimizer_state_dict(jm, optimizers, optim_state_dict, options=options)


def flatten(osd: dict) -> dict:
    """torch's flat form: ``state.<name>.<key>`` and ``param_groups.<name>.<key>`` (one entry per parameter)."""
    flat = {f"{STATE}.{name}.{key}": value for name, entry in osd[STATE].items() for key, value in entry.items()}
    for group in osd[GROUPS]:
        for name in group[PARAMS]:
            flat.update({f"{GROUPS}.{name}.{key}": value for key, value in group.items() if key != PARAMS})
    return flat


def unflatten(flat: dict, jm, optimizers) -> dict:
    """The nested form of a flat optimizer state dict, its groups those of ``optimizers``."""
    state: dict[str, dict] = {}
    for key, value in flat.items():
        if key.startswith(f"{STATE}."):
            name, _, entry_key = key[len(STATE) + 1 :].rpartition(".")
            state.setdefault(name, {})[entry_key] = value
    sharded, groups = fsdp_of(jm).model, []
    for optimizer in as_list(optimizers):
        names = optim_side.param_names(jm, sharded, optimizer)
        for g in optimizer.param_groups:
            members = [names[id(p)] for p in g[PARAMS]]
            prefix = f"{GROUPS}.{members[0]}." if members else None
            hyper = {k[len(prefix) :]: v for k, v in flat.items() if prefix and k.startswith(prefix)}
            groups.append({**hyper, PARAMS: members})
    return {STATE: state, GROUPS: groups}
