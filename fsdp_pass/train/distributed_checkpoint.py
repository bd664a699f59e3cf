"""Checkpoints in a folder, one sub-folder per saved step, each complete or absent: the model's and the
optimizers' state dicts written by ``torch.distributed.checkpoint`` (DCP), and the loop's own state.
Collective: every rank of the FSDP group calls both, with the same (shared) folder.

``save_checkpoint(directory, jm, optimizers, *, step, extra=None, keep=None) -> Path``
  1. Rank 0 clears a partial folder an earlier, interrupted save of this step may have left.
  2. DCP writes the state dicts (:func:`~fsdp_pass.train.state_dicts.get_state_dict`: DTensor views of
     the shards, nothing copied) into ``directory/.step-00000012.partial``, each rank its own rows; its
     save returns once rank 0 has written the metadata, after every rank reported its files.
  3. Rank 0 adds ``loop.pt`` (``step`` and ``extra``: whatever ``torch.save`` writes, e.g. an LR
     scheduler's ``state_dict()``), then renames the folder to ``directory/step-00000012``. A rename is
     atomic: a save that fails or is killed before it leaves every earlier checkpoint as it was.
  4. With ``keep``: complete checkpoints older than the newest ``keep`` are deleted.

``load_checkpoint(directory, jm, optimizers) -> Resumed(step, extra, path)``, or None without one
  The newest complete checkpoint, read into the model's shards and the optimizers' state at this world
  size, whatever world size saved it (DCP reads the rows each rank now holds); partial folders are ignored.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fsdp_pass.api import arrived
from fsdp_pass.errors import check, fail, file_work_on_rank0
from fsdp_pass.train.state_dicts import get_state_dict, set_state_dict

COMPLETE = re.compile(r"^step-(\d{8})$")
LOOP_FILE = "loop.pt"


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
    file_work_on_rank0(
        action, "", "Check that the checkpoint folder is writable and on a file system every rank sees.", group
    )


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
    partial, final = partial_folder(directory, step), step_folder(directory, step)
    _on_rank0(group, lambda: (shutil.rmtree(partial, ignore_errors=True), directory.mkdir(parents=True, exist_ok=True)))
    model_sd, optim_sd = get_state_dict(jm, optimizers)
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=partial, process_group=group)
    except CheckpointException as e:  # raised on every rank alike: DCP gathers each rank's outcome
        causes = {r: x[0] if isinstance(x, tuple) else x for r, x in e.failures.items()}  # (exception, frames)
        failures = "; ".join(f"rank {r}: {type(x).__name__}: {x}" for r, x in sorted(causes.items()))
        last = complete_checkpoints(directory)
        kept = (
            f"the last complete checkpoint, {last[-1][1].name}, is untouched"
            if last
            else "there is no earlier checkpoint"
        )
        fail(
            f"The checkpoint of step {step} was not written ({failures}); nothing was published: {kept}.",
            "Fix the cause and save again (the partial folder is cleared then); load_checkpoint() reads only "
            "complete checkpoints.",
        )

    def publish():
        torch.save({"step": step, "extra": extra, "world_size": dist.get_world_size(group)}, partial / LOOP_FILE)
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


def load_checkpoint(directory, jm, optimizers) -> Resumed | None:
    group = arrived(jm, "load_checkpoint()").groups.everyone
    found = complete_checkpoints(directory)
    # every rank must agree on which checkpoint it reads (a folder seen late on one rank would split them)
    newest = [str(found[-1][1]) if found else None]
    dist.broadcast_object_list(newest, src=dist.get_global_rank(group, 0), group=group)
    if newest[0] is None:
        return None
    path = Path(newest[0])
    model_sd, optim_sd = get_state_dict(jm, optimizers)  # views of the shards, a fresh optimizer's state made
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=group)
    set_state_dict(jm, optimizers, model_state_dict=model_sd, optim_state_dict=optim_sd)
    loop = torch.load(path / LOOP_FILE, weights_only=False)  # written by this library's save_checkpoint
    return Resumed(loop["step"], loop["extra"], path)
