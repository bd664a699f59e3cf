"""Checkpoints across gloo ranks (module-level functions, so spawned ranks can import them): train, save,
train on (the uninterrupted run), resume from the checkpoint at this or another world size, compare.

Every step of the loop is a real one: a global batch of 4 split over the ranks, gradients clipped by the
global norm, an optimizer step. Optimizers have two param groups (no weight decay on 1-D and 0-d
parameters), as real loops do.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import thunder
import torch
import torch.distributed as dist
from fsdp_pass_executors import executors_for
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions

import fsdp_pass
from fsdp_pass import FSDP, FSDPError
from fsdp_pass.train.checkpoint_manifest import MANIFEST_FILE, file_digests, write_manifest
from fsdp_pass.train.checkpoint_folders import complete_checkpoints, step_folder
from fsdp_pass.train.loop_state import LOOP_FILE
from tests import models
from tests.rank_cases import _local

GLOBAL_BATCH = 4
FULL = StateDictOptions(full_state_dict=True)


def _jit_module(model, strategy: str, **fsdp_kwargs):
    """Sharded at jit time; compiled at its first call only (loading or saving a checkpoint needs no compile)."""
    return thunder.jit(model, transforms=[FSDP(strategy, **fsdp_kwargs)], executors=executors_for("cpu"))


def _jit(model_name: str, strategy: str, model_config: dict | None = None, **fsdp_kwargs):
    # other weights than the saved ones; model_config: the model's constructor arguments (models.build)
    model = models.build(model_name, seed=dist.get_world_size(), config=model_config)
    return _jit_module(copy.deepcopy(model), strategy, **fsdp_kwargs)


def make_optimizer(jm, kind: str):
    decay = [p for p in jm.parameters() if p.ndim >= 2]
    no_decay = [p for p in jm.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=1e-2)
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9)


def train(jm, opt, model_name: str, steps: range) -> list[float]:
    """The loop: forward, backward, clip by the global norm, step. Returns the mean loss over ranks."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        x, y = models.batch(model_name, GLOBAL_BATCH, step)
        loss = models.loss_fn(model_name, jm(_local(x, rank, world_size)), _local(y, rank, world_size))
        loss.backward()
        fsdp_pass.clip_grad_norm_(jm, 1.0)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world_size)
    return losses


def _full_params(jm) -> dict[str, torch.Tensor]:
    full = fsdp_pass.full_state_dict(jm, cpu=True)
    return {k: v.clone() for k, v in full.items()}


def whole_state(jm, opt):
    """Model and optimizer state, full, on rank 0 (None elsewhere): what a resharded load must reproduce."""
    on_rank0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = fsdp_pass.get_state_dict(jm, opt, options=on_rank0)
    return (model_sd, optim_sd) if dist.get_rank() == 0 else None


def _same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _optimizer_states(opt) -> list[dict]:
    return [
        {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
        for g in opt.param_groups
        for p in g["params"]
    ]


def _same_states(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k] for k in x)
        for x, y in zip(a, b)
    )


def save_and_continue(
    model_name: str, strategy: str, optimizer: str, directory: str, k: int = 2, m: int = 2,
    model_config: dict | None = None, **fsdp_kwargs,
):
    """Train k steps, save, train m more (the uninterrupted run). Then, in the same process, load the checkpoint
    into the model with a fresh optimizer and train the same m steps again: bitwise the same."""
    rank = dist.get_rank()
    jm = _jit(model_name, strategy, model_config, **fsdp_kwargs)
    opt = make_optimizer(jm, optimizer)
    out = {"losses_before": train(jm, opt, model_name, range(k))}
    at_save = _full_params(jm)
    path = fsdp_pass.save_checkpoint(directory, jm, opt, step=k, extra={"seen": k * GLOBAL_BATCH})
    out["saved_to"] = str(path)
    out["state_at_save"] = whole_state(jm, opt)
    out["save_changed_nothing"] = _same(at_save, _full_params(jm))
    out["losses"] = train(jm, opt, model_name, range(k, k + m))
    uninterrupted = _full_params(jm)

    fresh = make_optimizer(jm, optimizer)
    resumed = fsdp_pass.load_checkpoint(directory, jm, fresh)
    out["resumed"] = (resumed.step, resumed.extra)
    out["loaded_params_exact"] = _same(at_save, _full_params(jm))
    out["resumed_losses"] = train(jm, fresh, model_name, range(k, k + m))
    out["resumed_params_bitwise"] = _same(uninterrupted, _full_params(jm))
    out["params"] = uninterrupted if rank == 0 else None

    original_keys = sorted(models.build(model_name, config=model_config).state_dict())
    sd = jm.state_dict()
    out["jm_state_dict_keys_match"] = sorted(sd) == original_keys
    out["jm_state_dict_plain"] = sorted(k for k, v in sd.items() if type(v).__name__ != "DTensor")
    return out


def full_and_flat_forms(model_name: str, strategy: str, optimizer: str, **fsdp_kwargs):
    """The full form on rank 0 (cpu_offload) set back through broadcast_from_rank0, and torch's flat form of the
    optimizer state: each round trip restores parameters and optimizer state exactly."""
    jm = _jit(model_name, strategy, **fsdp_kwargs)
    opt = make_optimizer(jm, optimizer)
    train(jm, opt, model_name, range(2))
    params, states = _full_params(jm), _optimizer_states(opt)
    on_rank0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full_model, full_optim = fsdp_pass.get_state_dict(jm, opt, options=on_rank0)
    out = {
        "full_keys": len(full_model),
        "full_devices": sorted({str(v.device) for v in full_model.values()}),
        "full_optim_entries": len(full_optim.get("state", {})),
        "full_shapes_match": all(tuple(v.shape) == tuple(params[k].shape) for k, v in full_model.items()),
    }
    with torch.no_grad():
        for p in jm.parameters():
            p.zero_()
    fresh = make_optimizer(jm, optimizer)
    broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    fsdp_pass.set_state_dict(jm, fresh, model_state_dict=full_model, optim_state_dict=full_optim, options=broadcast)
    out["broadcast_params_exact"] = _same(params, _full_params(jm))
    out["broadcast_optimizer_exact"] = _same_states(states, _optimizer_states(fresh))
    out["broadcast_groups"] = [g["weight_decay"] for g in fresh.param_groups]

    flat = fsdp_pass.get_optimizer_state_dict(jm, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    out["flat_keys_sample"] = sorted(flat)[:2]
    again = make_optimizer(jm, optimizer)
    fsdp_pass.set_optimizer_state_dict(jm, again, flat, options=StateDictOptions(flatten_optimizer_state_dict=True))
    out["flat_optimizer_exact"] = _same_states(states, _optimizer_states(again))

    # a full state dict without the tied name (as HF saves one) loads; one whose tied names differ does not
    full = fsdp_pass.get_model_state_dict(jm, options=FULL)
    tied = [s.name for s in fsdp_pass.fsdp_of(jm).sharding.params if s.is_tied]
    fsdp_pass.set_model_state_dict(jm, {k: v for k, v in full.items() if k not in tied}, options=FULL)
    out["tied"], out["loads_without_tied_names"] = tied, _same(params, _full_params(jm))
    try:
        fsdp_pass.set_model_state_dict(jm, {**full, tied[0]: full[tied[0]] + 1}, options=FULL)
        out["untied_values_error"] = None
    except FSDPError as e:
        out["untied_values_error"] = str(e)
    return out


def resume_elsewhere(
    model_name: str, strategy: str, optimizer: str, directory: str, k: int = 2, m: int = 2, keep: bool = False,
    model_config: dict | None = None, **fsdp_kwargs,
):
    """A fresh model and optimizer at this world size load the checkpoint saved at another, and train on.
    ``keep``: the model and optimizer under ``"jm"`` and ``"opt"`` too, for a caller on the rank."""
    jm = _jit(model_name, strategy, model_config, **fsdp_kwargs)
    opt = make_optimizer(jm, optimizer)
    resumed = fsdp_pass.load_checkpoint(directory, jm, opt)
    state_at_load = whole_state(jm, opt)
    losses = train(jm, opt, model_name, range(k, k + m))
    params = _full_params(jm)
    return ({"jm": jm, "opt": opt} if keep else {}) | {
        "resumed": (resumed.step, resumed.extra),
        "state_at_load": state_at_load,
        "losses": losses,
        "params": params if dist.get_rank() == 0 else None,
    }


def interrupted_save_and_misuse(
    model_name: str, strategy: str, optimizer: str, directory: str, k: int = 2, **fsdp_kwargs
):
    """A save that fails on one rank mid-write leaves the last good checkpoint loadable (``optimizer`` "sgd": with
    momentum); then state dicts that do not fit raise an FSDPError on every rank, naming the key, and load
    nothing."""
    rank = dist.get_rank()
    jm = _jit(model_name, strategy, **fsdp_kwargs)
    opt = make_optimizer(jm, optimizer)
    train(jm, opt, model_name, range(k))
    fsdp_pass.save_checkpoint(directory, jm, opt, step=k)
    at_save = _full_params(jm)
    out = {"losses_after_save": train(jm, opt, model_name, range(k, k + 1))}

    real_write = FileSystemWriter.write_data

    def failing_write(self, plan, planner):
        raise OSError("disk full (simulated, on rank 1)")

    if rank == 1:
        FileSystemWriter.write_data = failing_write
    try:
        fsdp_pass.save_checkpoint(directory, jm, opt, step=k + 1)
        out["failed_save"] = None
    except Exception as e:  # noqa: BLE001 - reported back to the test
        out["failed_save"] = f"{type(e).__name__}: {e}"
    finally:
        FileSystemWriter.write_data = real_write
    out["complete_steps"] = [c.step for c in complete_checkpoints(directory)]
    # loaded after a backward, into an optimizer that never stepped: its state is made anyway, the gradients kept
    x, y = models.batch(model_name, GLOBAL_BATCH, 0)
    world_size = dist.get_world_size()
    models.loss_fn(model_name, jm(_local(x, rank, world_size)), _local(y, rank, world_size)).backward()
    grads = [p.grad.clone() for p in jm.parameters()]
    fresh = make_optimizer(jm, optimizer)
    resumed = fsdp_pass.load_checkpoint(directory, jm, fresh)
    out["resumed_step"] = resumed.step
    out["resumed_exact"] = _same(at_save, _full_params(jm))
    out["state_with_grads_present"] = all("momentum_buffer" in fresh.state[p] for p in jm.parameters())
    out["grads_kept"] = all(torch.equal(g, p.grad) for g, p in zip(grads, jm.parameters()))
    jm.zero_grad()

    before = _full_params(jm)
    sharded_sd = fsdp_pass.get_model_state_dict(jm)
    full_sd = fsdp_pass.get_model_state_dict(jm, options=FULL)
    first = next(iter(full_sd))
    wrong_shape = {**full_sd, first: torch.zeros(4, 4)}
    missing = {k: v for k, v in sharded_sd.items() if k != first}
    unexpected = {**sharded_sd, "bogus.weight": torch.zeros(2)}
    attempts = {
        "full_into_sharded": lambda: fsdp_pass.set_model_state_dict(jm, full_sd),
        "sharded_into_full": lambda: fsdp_pass.set_model_state_dict(jm, sharded_sd, options=FULL),
        "missing": lambda: fsdp_pass.set_model_state_dict(jm, missing),
        "unexpected": lambda: fsdp_pass.set_model_state_dict(jm, unexpected),
        "wrong_shape": lambda: fsdp_pass.set_model_state_dict(jm, wrong_shape, options=FULL),
        "foreign_optimizer": lambda: fsdp_pass.get_state_dict(
            jm, torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=0.1)
        ),
        "optimizer_of_other_kind": lambda: fsdp_pass.set_optimizer_state_dict(
            jm,
            make_optimizer(jm, "adamw" if optimizer != "adamw" else "sgd"),
            fsdp_pass.get_optimizer_state_dict(jm, opt),
        ),
    }
    out["errors"] = {}
    for label, attempt in attempts.items():
        try:
            attempt()
            out["errors"][label] = None
        except FSDPError as e:
            out["errors"][label] = str(e)
    out["first_key"], out["first_shape"] = first, tuple(full_sd[first].shape)
    out["nothing_loaded"] = _same(before, _full_params(jm))
    out["damaged"] = damaged_and_foreign_checkpoints(jm, model_name, optimizer, directory, k, at_save)
    return out


class RunsCode:
    """Unpickled, it creates the file ``marker``: what a ``loop.pt`` from an untrusted source could do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (Path(self.marker),)


def _on_rank0_then_wait(action) -> None:
    if dist.get_rank() == 0:
        action()
    dist.barrier()


def _error_of(attempt) -> str | None:
    try:
        attempt()
        return None
    except FSDPError as e:
        return str(e)


def _plant_code_in_loop_file(folder: Path, marker: Path) -> None:
    """Rank 0 writes a loop.pt whose unpickling would run code; the manifest is rewritten to match, as a crafted
    folder's would be, so only the way loop.pt is read stands between it and every rank."""
    planted = {"step": 2, "extra": RunsCode(str(marker)), "world_size": 2}
    _on_rank0_then_wait(lambda: torch.save(planted, folder / LOOP_FILE))
    record = json.loads((folder / MANIFEST_FILE).read_text())
    digests = file_digests(folder, sorted(record["files"]), dist.group.WORLD)
    saved_as = {key: record[key] for key in ("step", "sequence", "parent")}
    _on_rank0_then_wait(lambda: write_manifest(folder, digests, **saved_as))


def damaged_and_foreign_checkpoints(jm, model_name: str, optimizer: str, directory: str, k: int, at_save: dict):
    """On from interrupted_save_and_misuse (``jm`` holds step ``k``'s checkpoint, saved in ``directory``): the newest
    of two checkpoints damaged, a checkpoint whose loop.pt would run code, checkpoints of another width and of
    another optimizer, an ``extra`` that could not be loaded back. Each is an FSDPError on every rank and loads
    nothing; ``step=k`` loads the older checkpoint, and training on gives the losses of the run that saved it."""
    out, directory = {}, Path(directory)
    opt = make_optimizer(jm, optimizer)
    train(jm, opt, model_name, range(k, k + 1))
    newest = fsdp_pass.save_checkpoint(directory, jm, opt, step=k + 1)
    train(jm, opt, model_name, range(k + 1, k + 2))  # the parameters now differ from both checkpoints'
    damaged = sorted(newest.glob("*.distcp"))[-1]
    _on_rank0_then_wait(lambda: os.truncate(damaged, damaged.stat().st_size // 2))
    out["damaged_file"], out["newest"], out["older"] = damaged.name, str(newest), str(step_folder(directory, k))
    before = _full_params(jm)
    out["damaged_error"] = _error_of(lambda: fsdp_pass.load_checkpoint(directory, jm, make_optimizer(jm, optimizer)))
    out["no_such_step_error"] = _error_of(lambda: fsdp_pass.load_checkpoint(directory, jm, opt, step=k + 5))
    out["damaged_loaded_nothing"] = _same(before, _full_params(jm))

    fresh = make_optimizer(jm, optimizer)
    resumed = fsdp_pass.load_checkpoint(directory, jm, fresh, step=k)
    out["older_resumed"] = (resumed.step, resumed.path.name)
    out["older_exact"] = _same(at_save, _full_params(jm))
    out["older_losses"] = train(jm, fresh, model_name, range(k, k + 1))

    refused_extra = {"schedule": {"lr_lambda": lambda step: 1.0}}
    out["extra_error"] = _error_of(
        lambda: fsdp_pass.save_checkpoint(directory, jm, fresh, step=k + 7, extra=refused_extra)
    )
    out["steps_after_refused_extra"] = [c.step for c in complete_checkpoints(directory)]

    marker = directory / "code-ran"
    _plant_code_in_loop_file(step_folder(directory, k), marker)
    before = _full_params(jm)
    out["code_error"] = _error_of(
        lambda: fsdp_pass.load_checkpoint(directory, jm, make_optimizer(jm, optimizer), step=k)
    )
    out["code_ran"], out["code_loaded_nothing"] = marker.exists(), _same(before, _full_params(jm))
    dist.barrier()
    if dist.get_rank() == 0:  # the plant is real: unpickled as torch.load(weights_only=False) would, it runs
        torch.load(step_folder(directory, k) / LOOP_FILE, weights_only=False)
        out["plant_runs_code_when_unpickled"] = marker.exists()

    # another width and another optimizer: models sharded and never run, so nothing compiles
    wide, narrow = _jit_module(models.MLP(hidden=48), "zero3"), _jit_module(models.MLP(hidden=32), "zero3")
    fsdp_pass.save_checkpoint(directory / "wide", wide, make_optimizer(wide, "adamw"), step=1)
    narrow_opt, sgd = make_optimizer(narrow, "adamw"), make_optimizer(wide, "sgd")
    before = [_full_params(narrow), _full_params(wide), _full_params(jm)]
    out["width_error"] = _error_of(lambda: fsdp_pass.load_checkpoint(directory / "wide", narrow, narrow_opt))
    out["optimizer_error"] = _error_of(lambda: fsdp_pass.load_checkpoint(directory / "wide", wide, sgd))
    out["keys_error"] = _error_of(lambda: fsdp_pass.load_checkpoint(directory / "wide", jm, fresh))
    after = [_full_params(narrow), _full_params(wide), _full_params(jm)]
    out["foreign_loaded_nothing"] = all(_same(a, b) for a, b in zip(before, after))
    out["fresh_optimizers_left_fresh"] = not narrow_opt.state and not sgd.state
    return out


def rank_extra(rank: int) -> dict:
    """What a loop keeps per rank (its data loader's position, its random generator's state: they differ by rank)
    beside what every rank shares (the schedule's state)."""
    return {
        "data": {"offset": 1000 * rank + 7},
        "rng": torch.Generator().manual_seed(rank).get_state(),
        "schedule": {"last_epoch": 3},
    }


def _unrun_mlp(seed: int):
    """An MLP sharded and never run (loading and saving compile nothing), its weights drawn from ``seed``."""
    torch.manual_seed(seed)
    jm = _jit_module(models.MLP(hidden=48), "zero3")
    return jm, make_optimizer(jm, "adamw")


def save_per_rank_extras(directory: str):
    """Saved twice at this world size: with each rank's own extra (``own``) and with one extra on every rank
    (``same``); both loaded back by a restarted run (other weights)."""
    rank, directory = dist.get_rank(), Path(directory)
    jm, opt = _unrun_mlp(seed=0)
    own = fsdp_pass.save_checkpoint(directory / "own", jm, opt, step=3, extra=rank_extra(rank))
    same = fsdp_pass.save_checkpoint(directory / "same", jm, opt, step=3, extra=rank_extra(0))
    files = {label: sorted(f.name for f in path.iterdir()) for label, path in (("own", own), ("same", same))}
    out = {"state_at_save": whole_state(jm, opt), "files": files}
    again, opt = _unrun_mlp(seed=1)
    out["own_extra"] = fsdp_pass.load_checkpoint(directory / "own", again, opt).extra
    out["state_at_load"] = whole_state(again, opt)
    out["same_extra"] = fsdp_pass.load_checkpoint(directory / "same", again, opt).extra
    return out


def load_per_rank_extras_elsewhere(directory: str):
    """``save_per_rank_extras``'s checkpoints loaded at another world size: the per-rank one refused, then loaded
    with ``per_rank_extra="all"``; the one with the same extra on every rank loaded as it is."""
    directory = Path(directory)
    jm, opt = _unrun_mlp(seed=1)
    before = _full_params(jm)
    out = {"own_error": _error_of(lambda: fsdp_pass.load_checkpoint(directory / "own", jm, opt))}
    out["loaded_nothing"] = _same(before, _full_params(jm))
    out["all_extras"] = fsdp_pass.load_checkpoint(directory / "own", jm, opt, per_rank_extra="all").extra
    out["state_at_load"] = whole_state(jm, opt)
    out["same_extra"] = fsdp_pass.load_checkpoint(directory / "same", jm, opt).extra
    return out
