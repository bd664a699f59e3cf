"""Checkpoints in a folder, one sub-folder per saved step, each complete or absent: the model's and the
optimizers' state dicts written by ``torch.distributed.checkpoint`` (DCP), the loop's own state, and a manifest
of the save (its place in the folder's sequence of saves) and of every file's size and sha256. Collective:
every rank of the FSDP group calls both, with the same folder, on a file system every rank sees. What they do
to the folder besides (checkpoints set aside, leftovers of interrupted saves) rank 0 says as a
:class:`CheckpointWarning`.

``save_checkpoint(directory, jm, optimizers, *, step, extra=None, keep=None) -> Path``
  1. ``extra`` must load with ``torch.load(weights_only=True)`` (tensors, numbers, strings, None, and dicts,
     lists, tuples of them: :mod:`.loop_state`); anything else is an FSDPError on every rank naming its path
     and type, before anything is written. The ranks compare their extras (a sha256 each).
  2. Rank 0 cleans what interrupted saves left (:func:`~.checkpoint_folders.clean_leftovers`, with a note).
  3. DCP writes the state dicts (:func:`~fsdp_pass.train.state_dicts.get_state_dict`: DTensor views of the
     shards, nothing copied) into ``directory/.step-00000012.partial``, each rank its own rows, fsynced; its
     save returns once rank 0 has written DCP's metadata, after every rank reported its files.
  4. Rank 0 adds ``loop.pt`` (``step``, the world size, each rank's extra's sha256, and ``extra`` where the
     ranks' are equal); where they differ, each rank writes its own to ``extra-0000r.pt``. Each is fsynced.
  5. The files to hash are those DCP's metadata names, ``.metadata``, ``loop.pt`` and the per-rank extras (not
     a listing of the folder); the ranks hash them, each file once (:mod:`.checkpoint_manifest`).
  6. Rank 0 publishes (:func:`~.checkpoint_publish.publish`): the save's sequence and the checkpoint this run
     loaded or last saved here into ``manifest.json``; the checkpoints of a later step, or saved after that
     one (a rollback's abandoned run), moved to ``directory/abandoned-K`` with a note; the renames that
     publish ``step-00000012`` (a re-save never leaves zero copies of the step); fsyncs; then ``keep``: all but
     the newest ``keep`` in sequence deleted, never the one just written.

``load_checkpoint(directory, jm, optimizers, step=None, *, map_location=None, per_rank_extra="own")
-> Resumed(step, extra, path)``, or None without one
  1. Rank 0 lists the complete checkpoints, names the leftovers of interrupted saves (a load writes nothing),
     and every rank takes its list. ``step=None`` picks the newest in sequence (the last saved), ``step=N`` that
     step's; partial folders are never read.
  2. The picked folder's files are checked against its manifest (sizes, sha256) before anything is read from
     them. A damaged one is an FSDPError on every rank naming the folder, the first damaged file and the
     newest checkpoint that verifies (to pass as ``step=``): ``step=None`` never falls back silently to an
     older checkpoint, which would throw away training without a word.
  3. ``loop.pt`` and the extras are read with ``torch.load(weights_only=True, map_location=map_location)``: a
     pickle that would run code is refused; a tensor saved on a device this process lacks is an FSDPError
     that says to pass ``map_location``. Each rank gets its own extra: the one every rank saved, or at the
     world size that saved them, the extra of its rank; at another world size, ranks whose extras differed
     are an FSDPError naming the first difference, unless ``per_rank_extra="all"`` (every saved rank's extra,
     a list by saved rank, for the caller to map).
  4. DCP's metadata (the saved keys and global shapes, the files it names: each must be in the manifest) is
     compared with the model's state dict, then with the optimizers' (a fresh optimizer's state is made for
     that, and cleared again if the checkpoint does not fit): another architecture or another kind of
     optimizer is an FSDPError naming the first key, both shapes and the folder. Every rank reaches the same
     verdict in steps 2-4, and nothing has been loaded.
  5. DCP reads into the model's shards and the optimizers' state the rows each rank now holds, whatever
     world size saved them. The next save into this folder goes on from this checkpoint (step 6 above).
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from fsdp_pass.api import arrived
from fsdp_pass.errors import FSDPError, check, fail, first_problem, value_from_rank0
from fsdp_pass.train.checkpoint_fit import misfit, saved_shapes, tensor_shapes
from fsdp_pass.train.checkpoint_folders import (
    Checkpoint,
    clean_leftovers,
    complete_checkpoints,
    leftovers,
    partial_folder,
)
from fsdp_pass.train.checkpoint_manifest import MANIFEST_FILE, METADATA_FILE, damage, file_digests, saved_files
from fsdp_pass.train.checkpoint_publish import publish
from fsdp_pass.train.loop_state import LOOP_FILE, read_loop_state, write_loop_state
from fsdp_pass.train.optimizer_state import STATE, as_list
from fsdp_pass.train.rank_extras import PER_RANK_EXTRA, extra_digests, extra_of_this_rank, write_rank_extras
from fsdp_pass.train.state_dicts import get_model_state_dict, get_optimizer_state_dict, get_state_dict, set_state_dict

WRITABLE = "Check that the checkpoint folder is writable and on a file system every rank sees."

# jm -> {folder: the sequence of the checkpoint it last loaded (0: one saved before saves were numbered) or saved
# there}: where the next save goes on from (the same on every rank: both are collective)
_LINEAGE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class CheckpointWarning(UserWarning):
    """What a save or a load did to, or found in, the checkpoint folder besides the checkpoint: checkpoints set
    aside after a rollback, leftovers of interrupted saves cleaned (at a save) or named (at a load). Rank 0 warns."""


@dataclass(frozen=True)
class Resumed:
    """What :func:`load_checkpoint` read besides the state dicts: ``extra`` is this rank's (or, with
    ``per_rank_extra="all"``, the list of every saved rank's)."""

    step: int
    extra: object
    path: Path


def _on_rank0(group, compute):
    return value_from_rank0(compute, WRITABLE, group)


def _warn(notes, group) -> None:
    if dist.get_rank(group) == 0:
        for note in notes:
            warnings.warn(note, CheckpointWarning, stacklevel=3)


def _failures(e: CheckpointException) -> str:
    causes = {r: x[0] if isinstance(x, tuple) else x for r, x in e.failures.items()}  # (exception, frames)
    return "; ".join(f"rank {r}: {type(x).__name__}: {x}" for r, x in sorted(causes.items()))


def _check_step(step, todo: str, allow_none: bool) -> None:
    check(
        (allow_none and step is None) or (isinstance(step, int) and not isinstance(step, bool) and step >= 0),
        f"step={step!r}: a checkpoint is named by a step number, a non-negative int.",
        todo,
    )


def _dcp_save(directory: Path, partial: Path, step: int, jm, optimizers, group) -> None:
    model_sd, optim_sd = get_state_dict(jm, optimizers)
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=partial, process_group=group)
    except CheckpointException as e:  # raised on every rank alike: DCP gathers each rank's outcome
        last = _on_rank0(group, lambda: complete_checkpoints(directory))
        kept = f"the last complete checkpoint, {last[-1].path.name}, is untouched" if last else (
            "there is no earlier checkpoint"
        )
        fail(
            f"The checkpoint of step {step} was not written ({_failures(e)}); nothing was published: {kept}.",
            "Fix the cause and save again (the partial folder is cleared then); load_checkpoint() reads only "
            "complete checkpoints.",
        )


def _write_loop_files(partial: Path, step: int, extra, digests: list[str], group) -> list[str]:
    """Each rank's extra where they differ, then loop.pt (rank 0); the names of every file of the save: those
    DCP's metadata names, its metadata, and these."""
    extras = write_rank_extras(partial, extra, digests, WRITABLE, group)

    def loop_file_and_names():
        write_loop_state(partial / LOOP_FILE, step, extra, dist.get_world_size(group), digests)
        written = saved_files(FileSystemReader(str(partial)).read_metadata())  # the metadata this job just wrote
        return [*written, METADATA_FILE, LOOP_FILE, *extras]

    return _on_rank0(group, loop_file_and_names)


def _prepared(directory: Path) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    return clean_leftovers(directory)


def save_checkpoint(directory, jm, optimizers, *, step: int, extra=None, keep: int | None = None) -> Path:
    _check_step(step, "Pass the number of optimizer steps taken so far, e.g. save_checkpoint(dir, jm, opt, step=step).",
                allow_none=False)
    check(
        keep is None or (isinstance(keep, int) and keep >= 1),
        f"keep={keep!r} keeps no checkpoint.",
        "Pass None (keep all) or an int >= 1.",
    )
    directory, group = Path(directory), arrived(jm, "save_checkpoint()").groups.everyone
    digests_of_extras = extra_digests(extra, group)
    partial = partial_folder(directory, step)
    _warn(_on_rank0(group, lambda: _prepared(directory)), group)
    _dcp_save(directory, partial, step, jm, optimizers, group)
    names = _write_loop_files(partial, step, extra, digests_of_extras, group)
    digests = file_digests(partial, names, group)  # every rank hashes its share of the files
    unread = next((f"{name}: {d['error']}" for name, d in digests.items() if "error" in d), None)
    check(unread is None, lambda: f"The checkpoint of step {step} could not be read back ({unread}).", WRITABLE)
    lineage = _LINEAGE.setdefault(jm, {})
    parent = lineage.get(directory.resolve())
    published = _on_rank0(group, lambda: publish(directory, partial, step, digests, parent=parent, keep=keep))
    lineage[directory.resolve()] = published.sequence
    _warn(published.notes, group)
    return published.path


def _pick(directory: Path, found: list[Checkpoint], step: int | None) -> Checkpoint:
    if step is None:
        newest = found[-1]  # in sequence: the last saved
        # a checkpoint whose manifest cannot be read has no known place: one of a later step may be the newest
        unknown = [c for c in found if not c.manifest_readable and c.step > newest.step]
        return max(unknown, key=lambda c: c.step) if unknown else newest
    picked = [c for c in found if c.step == step]
    check(
        bool(picked),
        lambda: f"step={step}: {directory} holds no complete checkpoint of step {step}; it holds steps "
        f"{[c.step for c in found]} (in the order they were saved).",
        "Pass one of those steps, or step=None for the newest.",
    )
    return picked[0]


def _check_verifies(directory: Path, picked: Checkpoint, found: list[Checkpoint], group) -> list[str]:
    """The files ``picked``'s manifest lists, once they match it; else an FSDPError on every rank, naming the
    newest checkpoint that does."""
    problem, files = damage(picked.path, group)
    if problem is None:
        return files
    good = next((c for c in reversed(found) if c.path != picked.path and damage(c.path, group)[0] is None), None)
    if good is None:
        fail(
            f"The checkpoint {picked.path} is damaged: {problem}. Nothing was loaded, and no other checkpoint in "
            f"{directory} verifies.",
            f"Restore {picked.path.name} from a copy ({MANIFEST_FILE} gives each file's size and sha256), or start "
            "without a checkpoint.",
        )
    fail(
        f"The checkpoint {picked.path} is damaged: {problem}. Nothing was loaded. The newest checkpoint that "
        f"verifies is {good.path}.",
        f"Load that one: load_checkpoint({str(directory)!r}, jm, optimizers, step={good.step}); and move "
        f"{picked.path.name} out of {directory} (or restore it from a copy) before its step is saved again.",
    )


def _read_loop(path: Path, map_location, group) -> dict:
    state, problem = read_loop_state(path / LOOP_FILE, map_location)
    problem = first_problem(problem, group)
    check(problem is None, lambda: f"The checkpoint {path} cannot be loaded: {problem[0]}. Nothing was loaded.",
          problem[1] if problem else "")
    return state


def _saved_shapes(path: Path, files: list[str], group) -> dict:
    """The checkpoint's keys and shapes, from DCP's metadata (a pickle: read only after the manifest verified),
    once every file it names is one the manifest verified."""
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
        shapes, problem = saved_shapes(metadata), None
        unlisted = [name for name in saved_files(metadata) if name not in files]
        if unlisted:
            problem = f"DCP's metadata names {unlisted[0]}, which its {MANIFEST_FILE} does not list (nor verify)"
    except Exception as e:  # noqa: BLE001 - reported on every rank
        shapes, problem = None, f"its DCP metadata cannot be read ({type(e).__name__}: {e})"
    problem = first_problem(problem, group)
    check(problem is None, lambda: f"The checkpoint {path} cannot be loaded: {problem}.", "Load another step.")
    return shapes


def _check_fits(path: Path, saved: dict, ours: dict, ours_to_load, group) -> None:
    problem = first_problem(misfit(saved, ours, ours_to_load), group)
    check(
        problem is None,
        lambda: f"The checkpoint {path} does not fit the model and optimizers it is loaded into: {problem}. "
        "Nothing was loaded.",
        "Load it into the architecture (sizes included) and the kind of optimizer that saved it; the world size, "
        "the strategy and the units may differ.",
    )


def _state_dicts_it_fits(path: Path, files: list[str], jm, optimizers, group) -> tuple[dict, dict]:
    """The model's and the optimizers' state dicts to load into, once the checkpoint's keys and shapes match
    theirs (the model's first: a fresh optimizer's state is made for the comparison, and cleared on a misfit)."""
    saved = _saved_shapes(path, files, group)
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


def _listed(directory: Path, group) -> list[Checkpoint]:
    """The complete checkpoints, as rank 0 sees them, on every rank (a folder seen late on one rank would split
    them); the leftovers of interrupted saves named."""
    found, notes = _on_rank0(group, lambda: (complete_checkpoints(directory), leftovers(directory)))
    _warn(notes, group)
    return found


def load_checkpoint(
    directory, jm, optimizers, step: int | None = None, *, map_location=None, per_rank_extra: str = "own"
) -> Resumed | None:
    _check_step(step, "Pass step=None for the newest checkpoint, or the step number of one.", allow_none=True)
    check(per_rank_extra in PER_RANK_EXTRA, f"per_rank_extra={per_rank_extra!r} is not one of {PER_RANK_EXTRA}.",
          "Pass 'own' (each rank its own extra) or 'all' (every saved rank's, a list).")
    directory, group = Path(directory), arrived(jm, "load_checkpoint()").groups.everyone
    found = _listed(directory, group)
    if not found:
        check(step is None, f"step={step}: {directory} holds no complete checkpoint.", "Pass step=None, or save first.")
        return None
    picked = _pick(directory, found, step)
    files = _check_verifies(directory, picked, found, group)
    loop = _read_loop(picked.path, map_location, group)
    extra = extra_of_this_rank(picked.path, loop, files, per_rank_extra, map_location, group)
    model_sd, optim_sd = _state_dicts_it_fits(picked.path, files, jm, optimizers, group)
    try:
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=picked.path, process_group=group)
    except CheckpointException as e:
        fail(
            f"Reading {picked.path} failed after it verified ({_failures(e)}); the model and the optimizers may "
            "hold part of it.",
            "Load it again (or another step) before training on.",
        )
    set_state_dict(jm, optimizers, model_state_dict=model_sd, optim_state_dict=optim_sd)
    _LINEAGE.setdefault(jm, {})[directory.resolve()] = picked.sequence or 0
    return Resumed(loop["step"], extra, picked.path)
