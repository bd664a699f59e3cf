"""The checkpoints in a folder, and what interrupted saves left beside them: names, the order of saves, and the
leftovers' clean-up. File work done by rank 0 alone (one process, no process group).

Names in ``directory`` (a step written with 8 digits or more: ``step-00000012``, ``step-100000000``):

- ``step-N``: a complete checkpoint of step N; its ``manifest.json`` gives its save sequence.
- ``.step-N.partial``: a save being written, or left by one that failed or was killed.
- ``.step-N.replaced``: step N's previous copy while a re-save of step N publishes. Alone (no ``step-N``: the
  re-save was killed between its two renames), it *is* step N's checkpoint.
- ``.step-N.deleting``: a checkpoint ``keep`` is deleting.
- ``abandoned-K``: checkpoints a save set aside (:mod:`.checkpoint_publish`), itself a folder of checkpoints.

``complete_checkpoints(directory) -> [Checkpoint]``, oldest first: by save sequence; those without one
(written before saves were numbered, or with a manifest that cannot be read) before the others, by step.

``leftovers(directory) -> [note]`` and ``clean_leftovers(directory) -> [note]``: the partial, replaced and
deleting folders, named (at a load: loading never writes, and a save may be running) or cleaned (at a save): a
lone ``.step-N.replaced`` is renamed back to ``step-N``, the others are deleted.

``fsync_path(path)``: a file's or a folder's entries on disk (after a rename: its parent folder's).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from fsdp_pass.train.checkpoint_manifest import manifest_sequence

_STEP = r"(\d{8,})"
COMPLETE = re.compile(rf"^step-{_STEP}$")
LEFTOVER = re.compile(rf"^\.step-{_STEP}\.(partial|replaced|deleting)$")


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint: its step, its folder, its place in the folder's saves (None: not known)."""

    step: int
    path: Path
    sequence: int | None = None
    manifest_readable: bool = True

    def order(self) -> tuple:
        return (self.sequence is not None, self.sequence if self.sequence is not None else self.step, self.step)


def step_folder(directory, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}"


def partial_folder(directory, step: int) -> Path:
    return Path(directory) / f".step-{step:08d}.partial"


def replaced_folder(directory, step: int) -> Path:
    return Path(directory) / f".step-{step:08d}.replaced"


def deleting_folder(directory, step: int) -> Path:
    return Path(directory) / f".step-{step:08d}.deleting"


def _step_of(name: str, pattern: re.Pattern) -> tuple[int, str] | None:
    """The step a folder name gives, written as step_folder writes it (no extra leading zero), and its kind."""
    found = pattern.match(name)
    if found is None or (len(found.group(1)) > 8 and found.group(1).startswith("0")):
        return None
    return int(found.group(1)), (found.group(2) if pattern.groups > 1 else "complete")


def _named(directory: Path, pattern: re.Pattern) -> list[tuple[int, str, Path]]:
    if not directory.is_dir():
        return []
    return sorted((*found, p) for p in directory.iterdir() if (found := _step_of(p.name, pattern)) and p.is_dir())


def complete_checkpoints(directory) -> list[Checkpoint]:
    directory = Path(directory)
    folders = {step: path for step, _, path in _named(directory, COMPLETE)}
    for step, kind, path in _named(directory, LEFTOVER):
        if kind == "replaced" and step not in folders:  # a re-save killed between its renames: the only copy
            folders[step] = path
    found = [Checkpoint(step, path, *manifest_sequence(path)) for step, path in folders.items()]
    return sorted(found, key=Checkpoint.order)


def _what_it_is(directory: Path, step: int, kind: str) -> tuple[str, bool]:
    """What a leftover folder is, and whether it is step N's only copy (to be renamed back, not deleted)."""
    if kind == "partial":
        return f"a save of step {step} that did not finish", False
    if kind == "deleting":
        return f"step {step}'s checkpoint, which keep= was deleting", False
    if step_folder(directory, step).is_dir():
        return f"the previous copy of step {step}, which a re-save of it replaced", False
    return f"step {step}'s checkpoint: a re-save of it was stopped between its two renames", True


def leftovers(directory) -> list[str]:
    """A note for each leftover folder: what it is, and what the next save does with it."""
    directory, notes = Path(directory), []
    for step, kind, path in _named(directory, LEFTOVER):
        what, only_copy = _what_it_is(directory, step, kind)
        then = f"renames it back to {step_folder(directory, step).name}" if only_copy else "deletes it"
        running = " (or one still running)" if kind == "partial" else ""
        notes.append(f"{path} is {what}{running}; the next save_checkpoint() {then}")
    return notes


def clean_leftovers(directory) -> list[str]:
    directory, notes = Path(directory), []
    for step, kind, path in _named(directory, LEFTOVER):
        what, only_copy = _what_it_is(directory, step, kind)
        if only_copy:
            path.rename(step_folder(directory, step))
            notes.append(f"renamed {path} ({what}) back to {step_folder(directory, step).name}")
        else:
            shutil.rmtree(path)
            notes.append(f"deleted {path} ({what})")
    if notes:
        fsync_path(directory)
    return notes


def fsync_path(path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
