"""Publishing a written checkpoint (rank 0's file work, once every rank's files are in ``.step-N.partial``): its
place in the folder's sequence of saves, the checkpoints it sets aside, the renames that make it visible, and
``keep``. One process, no process group.

``publish(directory, partial, step, digests, *, parent, keep) -> Published(path, sequence, notes)``
  1. Its sequence: one more than the folder's highest (``manifest.json`` records it, the step and ``parent``,
     the sequence of the checkpoint the saving run loaded or last saved in this folder). ``manifest.json`` and
     the folder are fsynced: every rank's files are then on disk (DCP and :mod:`.loop_state` fsync theirs).
  2. Set aside, into a new ``directory/abandoned-K``, every checkpoint that cannot be an earlier point of the
     run that saves: those of a later step than ``step``, and those saved after ``parent`` (a run that loaded
     step 8 of [8, 12] and saves step 10 has rolled back: 12 belongs to the run it abandoned). A note names
     them. Renames, fsynced: nothing is deleted.
  3. The renames that publish. A first save of step N: ``.step-N.partial -> step-N``. A re-save of step N:
         a. ``step-N -> .step-N.replaced``  (the old copy, still complete)
         b. ``.step-N.partial -> step-N``   (the new copy)
         c. fsync the folder, then delete ``.step-N.replaced``.
     A rename is atomic, and :func:`~.checkpoint_folders.complete_checkpoints` takes a lone ``.step-N.replaced``
     for step N. So a kill at any point leaves at least one complete copy of step N that a load finds: the old
     one up to (b), the new one from (b) on; and the next save renames a lone ``.step-N.replaced`` back or
     deletes one beside ``step-N`` (:func:`~.checkpoint_folders.clean_leftovers`).
  4. The folder is fsynced, then, with ``keep``, the checkpoints before the newest ``keep`` in sequence are
     deleted (each renamed ``.step-M.deleting`` first, so a kill mid-delete leaves no half checkpoint under a
     complete one's name). The checkpoint just written is the newest in sequence: ``keep`` never deletes it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from fsdp_pass.train.checkpoint_folders import (
    Checkpoint,
    complete_checkpoints,
    deleting_folder,
    fsync_path,
    replaced_folder,
    step_folder,
)
from fsdp_pass.train.checkpoint_manifest import write_manifest

ABANDONED = "abandoned-{}"


@dataclass(frozen=True)
class Published:
    path: Path
    sequence: int
    notes: tuple[str, ...] = ()


def _named(checkpoints: list[Checkpoint]) -> str:
    steps = ", ".join(str(c.step) for c in sorted(checkpoints, key=lambda c: c.step))
    return f"step {steps}" if len(checkpoints) == 1 else f"steps {steps}"


def _abandoned_folder(directory: Path) -> Path:
    k = 1
    while (directory / ABANDONED.format(k)).exists():
        k += 1
    return directory / ABANDONED.format(k)


def _note_aside(aside: list[Checkpoint], step: int, parent: int | None, found: list[Checkpoint], target: Path) -> str:
    later = [c for c in aside if c.step > step]
    after = [c for c in aside if c.step <= step]
    source = next((c for c in found if parent is not None and c.sequence == parent), None)
    why = [f"{_named(later)} {'is' if len(later) == 1 else 'are'} later than {step}"] if later else []
    loaded = f"step {source.step}" if source else "the checkpoint"
    why += [f"{_named(after)} {'was' if len(after) == 1 else 'were'} saved after {loaded}, which this run loaded or "
            "last saved"] if after else []
    it = "it" if len(aside) == 1 else "them"
    return (
        f"saving step {step}: moved {_named(aside)} to {target}, not deleted: {' and '.join(why)}, so "
        f"{'it belongs' if len(aside) == 1 else 'they belong'} to a run that was rolled back. "
        f"load_checkpoint({str(target)!r}, ...) still loads {it}; delete that folder once you no longer need {it}."
    )


def _set_aside(directory: Path, step: int, parent: int | None, found: list[Checkpoint]) -> str | None:
    aside = [c for c in found if c.step > step or (parent is not None and c.sequence is not None
                                                   and c.sequence > parent)]
    if not aside:
        return None
    target = _abandoned_folder(directory)
    target.mkdir()
    for c in aside:
        c.path.rename(step_folder(target, c.step))
    fsync_path(target)
    fsync_path(directory)
    return _note_aside(aside, step, parent, found, target)


def _rename_into_place(directory: Path, partial: Path, step: int) -> None:
    final = step_folder(directory, step)
    if not final.exists():
        partial.rename(final)
        fsync_path(directory)
        return
    old = replaced_folder(directory, step)
    final.rename(old)  # (a): a kill from here to (b) leaves the old copy, which a load takes for step N
    partial.rename(final)  # (b)
    fsync_path(directory)
    shutil.rmtree(old)


def _keep_newest(directory: Path, keep: int) -> None:
    for c in complete_checkpoints(directory)[:-keep]:
        doomed = deleting_folder(directory, c.step)
        c.path.rename(doomed)
        shutil.rmtree(doomed)


def publish(directory, partial, step: int, digests: dict, *, parent: int | None, keep: int | None) -> Published:
    directory, partial = Path(directory), Path(partial)
    found = complete_checkpoints(directory)
    sequence = 1 + max((c.sequence for c in found if c.sequence is not None), default=0)
    write_manifest(partial, digests, step=step, sequence=sequence, parent=parent)
    fsync_path(partial)
    moved = _set_aside(directory, step, parent, found)
    _rename_into_place(directory, partial, step)
    if keep is not None:
        _keep_newest(directory, keep)
    return Published(step_folder(directory, step), sequence, (moved,) if moved else ())
