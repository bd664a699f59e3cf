"""Checkpoints in a folder, one sub-folder per saved step, each complete or absent: the model's and the
optimizers' state dicts written by ``torch.distributed.checkpoint`` (DCP), the loop's own state, and a manifest
of every file's size and sha256. Collective: every rank of the FSDP group calls both, with the same folder, on
a file system every rank sees.

``save_checkpoint(directory, jm, optimizers, *, step, extra=None, keep=None) -> Path``
  1. ``extra`` must load with ``torch.load(weights_only=True)`` (tensors, numbers, strings, None, and dicts,
     lists, tuples of them: :mod:`.loop_state`); anything else is an FSDPError on every rank naming its path
     and type, before anything is written. Rank 0 clears a partial folder an interrupted save left.
  2. DCP writes the state dicts (:func:`~fsdp_pass.train.state_dicts.get_state_dict`: DTensor views of the
     shards, nothing copied) into ``directory/.step-00000012.partial``, each rank its own rows; its save
     returns once rank 0 has written DCP's metadata, after every rank reported its files.
  3. Rank 0 adds ``loop.pt`` (``step``, ``extra``, the world size). The ranks hash the folder's files, each
     file once (:mod:`.checkpoint_manifest`); rank 0 writes ``manifest.json`` and renames the folder to
     ``directory/step-00000012``. A rename is atomic: a save that fails or is killed leaves every earlier
     checkpoint as it was.
  4. With ``keep``: complete checkpoints older than the newest ``keep`` are deleted.

``load_checkpoint(directory, jm, optimizers, step=None) -> Resumed(step, extra, path)``, or None without one
  1. Rank 0 lists the complete checkpoints, and every rank takes its list. ``step=None`` picks the newest,
     ``step=N`` that step's; partial folders are never read.
  2. The picked folder's files are checked against its manifest (sizes, sha256) before anything is read from
     them. A damaged one is an FSDPError on every rank naming the folder, the first damaged file and the
     newest checkpoint that verifies (to pass as ``step=``): ``step=None`` never falls back silently to an
     older checkpoint, which would throw away training without a word.
  3. ``loop.pt`` is read with ``torch.load(weights_only=True)``: a pickle that would run code is refused.
  4. DCP's metadata (the saved keys and global shapes) is compared with the model's state dict, then with the
     optimizers' (a fresh optimizer's state is made for that, and cleared again if the checkpoint does not
     fit): another architecture or another kind of optimizer is an FSDPError naming the first key, both
     shapes and the folder. Every rank reaches the same verdict in steps 2-4, and nothing has been loaded.
  5. DCP reads into the model's shards and the optimizers' state the rows each rank now holds, whatever
     world size saved them.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from fsdp_pass.api import arrived
from fsdp_pass.errors import FSDPError, check, check_on_all_ranks, fail, file_work_on_rank0
from fsdp_pass.train.checkpoint_fit import misfit, saved_shapes, tensor_shapes
from fsdp_pass.train.checkpoint_manifest import MANIFEST_FILE, damage, file_digests, write_manifest
from fsdp_pass.train.loop_state import LOOP_FILE, read_loop_state, refused_part, write_loop_state
from fsdp_pass.train.optimizer_state import STATE, as_list
from fsdp_pass.train.state_dicts import get_model_state_dict, get_optimizer_state_dict, get_state_dict, set_state_dict

COMPLETE = re.compile(r"^step-(\d{8})$")
WRITABLE = "Check that the checkpoint folder is writable and on a file system every rank sees."


@dataclass(frozen=True)
class Resumed:
    """What :func:`load_checkpoint` read besides the state dicts."""

    step: int
    extra: object
    path: Path


def step_folder(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}"


def partial_folder(directory: Path, step: int) -> Path:
    return directory / f".step-{step:08d}.partial"


def complete_checkpoints(directory) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint in ``directory``, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := COMPLETE.match(p.name)) and p.is_dir()]
    return sorted(found)


def _on_rank0(group, action) -> None:
    """Run ``action`` on rank 0; every rank raises if it failed (and waits for it: a barrier)."""
    file_work_on_rank0(action, "", WRITABLE, group)


def _from_rank0(group, compute):
    """``compute()`` on rank 0, its value on every rank; an OSError there is an FSDPError on every rank."""
    sent = [None, None]
    if dist.get_rank(group) == 0:
        try:
            sent[0] = compute()
        except OSError as e:
            sent[1] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(sent, src=dist.get_global_rank(group, 0), group=group)
    check(sent[1] is None, lambda: sent[1], WRITABLE)
    return sent[0]


def _agreed(problem: str | None, group) -> str | None:
    """The first rank's problem (a sentence, or None), on every rank: one verdict, one message."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, problem, group=group)
    return next((p for p in everyone if p is not None), None)


def _failures(e: CheckpointException) -> str:
    causes = {r: x[0] if isinstance(x, tuple) else x for r, x in e.failures.items()}  # (exception, frames)
    return "; ".join(f"rank {r}: {type(x).__name__}: {x}" for r, x in sorted(causes.items()))


def _check_extra(extra, group) -> None:
    refused = refused_part(extra)
    check_on_all_ranks(
        refused
        and (
            f"save_checkpoint() cannot save extra: {refused}. load_checkpoint() reads extra back with "
            "torch.load(weights_only=True), which runs no code from the file and so loads only tensors, numbers, "
            "strings, bools, None, dtypes, devices, and dicts, lists, tuples and sets of them."
        ),
        "Save what rebuilds it instead (its state_dict(), numbers, strings), and rebuild it after load_checkpoint().",
        group,
    )


def _write_loop_state_and_list(partial: Path, step: int, extra, world_size: int) -> list[str]:
    write_loop_state(partial / LOOP_FILE, step, extra, world_size)
    return sorted(p.name for p in partial.iterdir() if p.is_file())


def save_checkpoint(directory, jm, optimizers, *, step: int, extra=None, keep: int | None = None) -> Path:
    check(
        isinstance(step, int) and step >= 0,
        f"step={step!r}: a checkpoint is named by a step number, a non-negative int.",
        "Pass the number of optimizer steps taken so far, e.g. save_checkpoint(dir, jm, opt, step=step).",
    )
    check(
        keep is None or (isinstance(keep, int) and keep >= 1),
        f"keep={keep!r} keeps no checkpoint.",
        "Pass None (keep all) or an int >= 1.",
    )
    directory, group = Path(directory), arrived(jm, "save_checkpoint()").groups.everyone
    _check_extra(extra, group)
    partial, final = partial_folder(directory, step), step_folder(directory, step)
    _on_rank0(group, lambda: (shutil.rmtree(partial, ignore_errors=True), directory.mkdir(parents=True, exist_ok=True)))
    model_sd, optim_sd = get_state_dict(jm, optimizers)
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=partial, process_group=group)
    except CheckpointException as e:  # raised on every rank alike: DCP gathers each rank's outcome
        last = complete_checkpoints(directory)
        kept = (
            f"the last complete checkpoint, {last[-1][1].name}, is untouched"
            if last
            else "there is no earlier checkpoint"
        )
        fail(
            f"The checkpoint of step {step} was not written ({_failures(e)}); nothing was published: {kept}.",
            "Fix the cause and save again (the partial folder is cleared then); load_checkpoint() reads only "
            "complete checkpoints.",
        )
    world_size = dist.get_world_size(group)
    names = _from_rank0(group, lambda: _write_loop_state_and_list(partial, step, extra, world_size))
    digests = file_digests(partial, names, group)  # every rank hashes its share of the files
    unread = next((f"{name}: {d['error']}" for name, d in digests.items() if "error" in d), None)
    check(unread is None, lambda: f"The checkpoint of step {step} could not be read back ({unread}).", WRITABLE)

    def publish():
        write_manifest(partial, digests)
        if final.exists():  # the same step saved again: the new one replaces it
            old = directory / f".step-{step:08d}.replaced"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            partial.rename(final)
            shutil.rmtree(old)
        else:
            partial.rename(final)
        if keep is not None:
            for _, older in complete_checkpoints(directory)[:-keep]:
                shutil.rmtree(older)

    _on_rank0(group, publish)
    return final


def _pick(directory: Path, found: list[tuple[int, Path]], step: int | None) -> tuple[int, Path]:
    if step is None:
        return found[-1]
    picked = [(s, p) for s, p in found if s == step]
    check(
        bool(picked),
        lambda: f"step={step}: {directory} holds no complete checkpoint of step {step}; it holds steps "
        f"{[s for s, _ in found]}.",
        "Pass one of those steps, or step=None for the newest.",
    )
    return picked[0]


def _check_verifies(directory: Path, picked: tuple[int, Path], found: list[tuple[int, Path]], group) -> None:
    """An FSDPError on every rank if ``picked`` does not match its manifest, naming the newest that does."""
    problem = damage(picked[1], group)
    if problem is None:
        return
    good = next(((s, p) for s, p in reversed(found) if p != picked[1] and damage(p, group) is None), None)
    if good is None:
        fail(
            f"The checkpoint {picked[1]} is damaged: {problem}. Nothing was loaded, and no other checkpoint in "
            f"{directory} verifies.",
            f"Restore {picked[1].name} from a copy ({MANIFEST_FILE} gives each file's size and sha256), or start "
            "without a checkpoint.",
        )
    fail(
        f"The checkpoint {picked[1]} is damaged: {problem}. Nothing was loaded. The newest checkpoint that "
        f"verifies is {good[1]}.",
        f"Load that one: load_checkpoint({str(directory)!r}, jm, optimizers, step={good[0]}); and move "
        f"{picked[1].name} out of {directory} (or restore it from a copy) before its step is saved again.",
    )


def _read_loop(path: Path, group) -> dict:
    state, problem = read_loop_state(path / LOOP_FILE)
    problem = _agreed(problem, group)
    check(
        problem is None,
        lambda: f"The checkpoint {path} cannot be loaded: {problem}. Nothing was loaded.",
        "Load only checkpoints written by fsdp_pass.save_checkpoint from a source you trust; its extra holds only "
        "tensors, numbers, strings and containers of them.",
    )
    return state


def _saved_shapes(path: Path, group) -> dict:
    """The checkpoint's keys and shapes, from DCP's metadata (a pickle: read only after the manifest verified)."""
    try:
        shapes, problem = saved_shapes(FileSystemReader(str(path)).read_metadata()), None
    except Exception as e:  # noqa: BLE001 - reported on every rank
        shapes, problem = None, f"its DCP metadata cannot be read ({type(e).__name__}: {e})"
    problem = _agreed(problem, group)
    check(problem is None, lambda: f"The checkpoint {path} cannot be loaded: {problem}.", "Load another step.")
    return shapes


def _check_fits(path: Path, saved: dict, ours: dict, ours_to_load, group) -> None:
    problem = _agreed(misfit(saved, ours, ours_to_load), group)
    check(
        problem is None,
        lambda: f"The checkpoint {path} does not fit the model and optimizers it is loaded into: {problem}. "
        "Nothing was loaded.",
        "Load it into the architecture (sizes included) and the kind of optimizer that saved it; the world size, "
        "the strategy and the units may differ.",
    )


def _state_dicts_it_fits(path: Path, jm, optimizers, group) -> tuple[dict, dict]:
    """The model's and the optimizers' state dicts to load into, once the checkpoint's keys and shapes match
    theirs (the model's first: a fresh optimizer's state is made for the comparison, and cleared on a misfit)."""
    saved = _saved_shapes(path, group)
    model_sd = get_model_state_dict(jm)  # views of the shards
    _check_fits(path, saved, tensor_shapes(model_sd, "model"), lambda key: key.startswith("model."), group)
    fresh = [o for o in as_list(optimizers) if not o.state]
    optim_sd = get_optimizer_state_dict(jm, optimizers)
    held = tuple(f"optim.{STATE}.{name}." for name in optim_sd.get(STATE, {}))
    try:
        _check_fits(path, saved, tensor_shapes(optim_sd, "optim"), lambda key: key.startswith(held), group)
    except FSDPError:
        for optimizer in fresh:  # as it was: loading nothing leaves a fresh optimizer fresh
            optimizer.state.clear()
        raise
    return model_sd, optim_sd


def load_checkpoint(directory, jm, optimizers, step: int | None = None) -> Resumed | None:
    check(
        step is None or (isinstance(step, int) and step >= 0),
        f"step={step!r}: a checkpoint is named by a step number, a non-negative int.",
        "Pass step=None for the newest checkpoint, or the step number of one.",
    )
    directory, group = Path(directory), arrived(jm, "load_checkpoint()").groups.everyone
    # every rank must read the same checkpoint (a folder seen late on one rank would split them)
    found = _from_rank0(group, lambda: complete_checkpoints(directory))
    if not found:
        check(step is None, f"step={step}: {directory} holds no complete checkpoint.", "Pass step=None, or save first.")
        return None
    picked = _pick(directory, found, step)
    path = picked[1]
    _check_verifies(directory, picked, found, group)
    loop = _read_loop(path, group)
    model_sd, optim_sd = _state_dicts_it_fits(path, jm, optimizers, group)
    try:
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=group)
    except CheckpointException as e:
        fail(
            f"Reading {path} failed after it verified ({_failures(e)}); the model and the optimizers may hold part "
            "of it.",
            "Load it again (or another step) before training on.",
        )
    set_state_dict(jm, optimizers, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return Resumed(loop["step"], loop["extra"], path)
