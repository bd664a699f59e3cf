"""Checkpoint folders, in this process alone (a one-rank gloo group; a small MLP sharded and never run, so nothing
compiles): the newest checkpoint and ``keep`` after a rollback, steps of 10**8, a re-save stopped at each of its
file operations, fsync before anything older is deleted, leftovers of interrupted saves, the manifest's files from
DCP's metadata, a byte flipped at the same size, ``map_location``, and checkpoints of the previous format.
Each checkpoint's parameters are all one value (its step, or a value given), so a load tells which one it read."""

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import thunder
import torch
from fsdp_pass_executors import executors_for
from torch.distributed.checkpoint import FileSystemReader

import fsdp_pass
from fsdp_pass import FSDP, CheckpointWarning, FSDPError
from tests import models
from tests.checkpoint_cases import make_optimizer
from tests.one_rank import one_rank


@pytest.fixture(scope="module")
def group():
    with one_rank():
        yield


def _run():
    """A run's model and optimizer (a new one: a restarted job)."""
    jm = thunder.jit(models.MLP(), transforms=[FSDP("zero3")], executors=executors_for("cpu"))
    return jm, make_optimizer(jm, "sgd")


def _notes(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]


def save(directory, run, step: int, value: float | None = None, **kwargs) -> tuple[Path, list[str]]:
    """Every parameter set to ``value`` (default: the step), then saved; the path and the notes."""
    jm, opt = run
    with torch.no_grad():
        for p in jm.parameters():
            p.fill_(step if value is None else value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = fsdp_pass.save_checkpoint(directory, jm, opt, step=step, extra={"step": step}, **kwargs)
    return path, _notes(caught)


def load(directory, run, **kwargs):
    """(Resumed, the one value of every parameter after the load (None: not one value), the notes)."""
    jm, opt = run
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = fsdp_pass.load_checkpoint(directory, jm, opt, **kwargs)
    values = {float(v) for t in fsdp_pass.full_state_dict(jm, cpu=True).values() for v in t.flatten()}
    return resumed, (values.pop() if len(values) == 1 else None), _notes(caught)


def steps(directory) -> list[int]:
    return sorted(int(p.name[len("step-"):]) for p in Path(directory).glob("step-*"))


def hidden(directory) -> list[str]:
    return sorted(p.name for p in Path(directory).iterdir() if p.name.startswith("."))


def test_a_save_after_a_rollback_sets_the_later_steps_aside_and_a_restart_resumes_it(group, tmp_path):
    """Steps [8, 12]; a run loads step 8 and saves step 10 with keep=2: 8 and 10 stay (12 moved aside, named),
    and a restart with step=None resumes step 10, not the abandoned 12."""
    first = _run()
    save(tmp_path, first, 8)
    save(tmp_path, first, 12)
    rolled_back = _run()
    assert load(tmp_path, rolled_back, step=8)[:2][1] == 8
    path, notes = save(tmp_path, rolled_back, 10, keep=2)
    assert path.is_dir() and steps(tmp_path) == [8, 10]
    aside = tmp_path / "abandoned-1"
    assert [p.name for p in aside.iterdir()] == ["step-00000012"]
    assert len(notes) == 1 and "step 12" in notes[0] and str(aside) in notes[0] and "rolled back" in notes[0], notes
    resumed, value, _ = load(tmp_path, _run())
    assert (resumed.step, resumed.extra, value) == (10, {"step": 10}, 10)
    assert load(aside, _run())[0].step == 12  # still loadable where it was moved
    # the run goes on from 10: its next saves are the newest, and keep=2 deletes 8, never what it wrote
    save(tmp_path, rolled_back, 14, keep=2)
    assert steps(tmp_path) == [10, 14] and load(tmp_path, _run())[1] == 14


def test_a_rollback_to_before_a_later_save_sets_aside_what_the_abandoned_run_saved(group, tmp_path):
    """Steps [4, 8, 12]; a run loads 4 and its next save is step 16: 8 and 12 were saved after 4 by the abandoned
    run, so they go aside too, though their steps are lower than 16."""
    first = _run()
    for step in (4, 8, 12):
        save(tmp_path, first, step)
    rolled_back = _run()
    load(tmp_path, rolled_back, step=4)
    _, notes = save(tmp_path, rolled_back, 16)
    assert steps(tmp_path) == [4, 16] and steps(tmp_path / "abandoned-1") == [8, 12]
    assert "steps 8, 12 were saved after step 4" in notes[0], notes


def test_keep_never_deletes_the_checkpoint_it_just_wrote(group, tmp_path):
    """Saving step 4 with keep=2 into [8, 12]: step 4 is written and is the newest; 8 and 12 are moved aside."""
    first = _run()
    save(tmp_path, first, 8)
    save(tmp_path, first, 12)
    path, notes = save(tmp_path, _run(), 4, keep=2)
    assert path.is_dir() and steps(tmp_path) == [4], steps(tmp_path)
    assert "steps 8, 12 are later than 4" in notes[0] and "abandoned-1" in notes[0], notes
    resumed, value, _ = load(tmp_path, _run())
    assert (resumed.step, value) == (4, 4)


def test_steps_of_10_to_the_8_and_more_are_found_and_kept(group, tmp_path):
    run = _run()
    for value, step in enumerate((99_999_999, 10**8, 10**8 + 1)):  # float32 parameters: small values
        save(tmp_path, run, step, value=value, keep=2)
    assert steps(tmp_path) == [10**8, 10**8 + 1] and (tmp_path / "step-100000001").is_dir()
    resumed, value, _ = load(tmp_path, _run())
    assert (resumed.step, value) == (10**8 + 1, 2)
    assert load(tmp_path, _run(), step=10**8)[:2][1] == 1


class Stop(Exception):
    """A kill, simulated: raised at one file operation, so nothing after it runs."""


def _file_operations(monkeypatch, stop_at: int | None, seen: list):
    """Count (and at ``stop_at``, stop at) every rename, replace and tree deletion, from here on."""
    real_rename, real_replace, real_rmtree = Path.rename, os.replace, shutil.rmtree

    def operation(name, real):
        def run(*args, **kwargs):
            seen.append((name, *(Path(a).name for a in args[:2])))
            if len(seen) == stop_at:
                raise Stop(f"stopped before {seen[-1]}")
            return real(*args, **kwargs)

        return run

    monkeypatch.setattr(Path, "rename", operation("rename", real_rename))
    monkeypatch.setattr(os, "replace", operation("replace", real_replace))
    monkeypatch.setattr(shutil, "rmtree", operation("rmtree", real_rmtree))


def _resave_stopped_at(directory: Path, stop_at: int | None) -> list:
    """Step 8 saved (parameters 1.0), then saved again (2.0), stopped at file operation ``stop_at``."""
    run = _run()
    save(directory, run, 8, value=1.0)
    seen = []
    with pytest.MonkeyPatch.context() as monkeypatch:
        _file_operations(monkeypatch, stop_at, seen)
        try:
            save(directory, run, 8, value=2.0)
        except (Stop, FSDPError) as e:  # a Stop on rank 0 reaches every rank as an FSDPError
            assert "stopped before" in str(e)
    return seen


def test_a_resave_stopped_at_any_file_operation_leaves_a_complete_step(group, tmp_path):
    """A re-save of step 8 stopped before each of its renames and deletions in turn (DCP's own included): a load
    then finds step 8, the old copy before the new one's rename into place and the new one from it on; it names
    what the save left, and the next save cleans it up."""
    operations = _resave_stopped_at(tmp_path / "whole", None)
    published = operations.index(("rename", ".step-00000008.partial", "step-00000008"))
    assert ("rename", "step-00000008", ".step-00000008.replaced") in operations[:published], operations
    for stop_at in range(1, len(operations) + 1):
        directory = tmp_path / str(stop_at)
        _resave_stopped_at(directory, stop_at)
        resumed, value, notes = load(directory, _run())
        expected = 2.0 if stop_at > published + 1 else 1.0
        assert resumed is not None and (resumed.step, value) == (8, expected), (stop_at, operations, hidden(directory))
        assert len(notes) == len(hidden(directory)), (stop_at, notes)
        _, cleaned = save(directory, _run(), 12)
        assert len(cleaned) == len(notes) and hidden(directory) == [] and steps(directory) == [8, 12], stop_at
        assert load(directory, _run(), step=8)[1] == expected, stop_at


def test_everything_is_fsynced_before_an_older_checkpoint_is_deleted(group, tmp_path, monkeypatch):
    """keep=1: the new checkpoint's files (DCP's, loop.pt, manifest.json: some fsynced under a temporary name, so
    they are told by inode), its folder, and the checkpoint folder after the rename that published it, are on disk
    before step 4 is deleted."""
    run = _run()
    save(tmp_path, run, 4)
    events, real_fsync, real_rmtree, real_rename = [], os.fsync, shutil.rmtree, Path.rename

    def fsync(descriptor):
        events.append(("fsync", os.fstat(descriptor).st_ino))
        return real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(shutil, "rmtree", lambda path, *a, **k: (events.append(("rmtree", Path(path).name)),
                                                                  real_rmtree(path, *a, **k))[1])
    monkeypatch.setattr(Path, "rename", lambda path, to: (events.append(("rename", Path(to).name)),
                                                          real_rename(path, to))[1])
    save(tmp_path, run, 8, keep=1)
    assert steps(tmp_path) == [8]
    final = tmp_path / "step-00000008"
    first_delete = next(i for i, e in enumerate(events) if e[0] == "rmtree")
    published = events.index(("rename", final.name))
    synced = {inode for kind, inode in events[:first_delete] if kind == "fsync"}
    files = {p.name: p.stat().st_ino for p in final.iterdir()}
    assert {"loop.pt", "manifest.json", ".metadata"} <= set(files) and any(n.endswith(".distcp") for n in files)
    assert set(files.values()) <= synced, [name for name, inode in files.items() if inode not in synced]
    assert final.stat().st_ino in synced
    assert ("fsync", tmp_path.stat().st_ino) in events[published:first_delete], events


def test_leftovers_are_named_at_a_load_and_cleaned_at_the_next_save(group, tmp_path):
    run = _run()
    save(tmp_path, run, 3)
    (tmp_path / ".step-00000005.partial").mkdir()
    (tmp_path / ".step-00000005.partial" / "__0_0.distcp").write_bytes(b"half")
    shutil.copytree(tmp_path / "step-00000003", tmp_path / ".step-00000003.replaced")
    shutil.copytree(tmp_path / "step-00000003", tmp_path / ".step-00000006.deleting")
    leftovers = hidden(tmp_path)
    resumed, value, notes = load(tmp_path, _run())
    assert (resumed.step, value) == (3, 3) and hidden(tmp_path) == leftovers  # a load writes nothing
    assert len(notes) == 3 and all(any(name in note for note in notes) for name in leftovers), notes
    assert all("the next save_checkpoint() deletes it" in note for note in notes), notes
    _, cleaned = save(tmp_path, run, 7)
    assert hidden(tmp_path) == [] and steps(tmp_path) == [3, 7]
    assert len(cleaned) == 3 and all(any(name in note for note in cleaned) for name in leftovers), cleaned


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def _rewrite(folder: Path, name: str, change) -> None:
    """``change(manifest)`` written back, or for a file, the file rewritten and its manifest entry to match."""
    record = _manifest(folder)
    if name == "manifest.json":
        change(record)
    else:
        change(folder / name)
        data = (folder / name).read_bytes()
        record["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(record))


def test_the_manifest_lists_the_files_dcp_wrote_and_a_load_checks_it_does(group, tmp_path, monkeypatch):
    real_save = torch.distributed.checkpoint.save

    def save_and_drop_a_stray_file(state_dict, *, checkpoint_id, **kwargs):
        metadata = real_save(state_dict, checkpoint_id=checkpoint_id, **kwargs)
        (Path(checkpoint_id) / "notes.txt").write_text("not part of the checkpoint")
        return metadata

    monkeypatch.setattr(torch.distributed.checkpoint, "save", save_and_drop_a_stray_file)
    path, _ = save(tmp_path, _run(), 2)
    written = {info.relative_path for info in FileSystemReader(str(path)).read_metadata().storage_data.values()}
    assert written and set(_manifest(path)["files"]) == written | {".metadata", "loop.pt"}
    distcp = sorted(written)[0]
    _rewrite(path, "manifest.json", lambda record: record["files"].pop(distcp))
    with pytest.raises(FSDPError, match=f"DCP's metadata names {distcp}, which its manifest.json does not list"):
        load(tmp_path, _run())


def test_a_byte_flipped_at_the_same_size_is_found_by_its_sha256(group, tmp_path):
    run = _run()
    save(tmp_path, run, 1)
    path, _ = save(tmp_path, run, 2)
    distcp = sorted(path.glob("*.distcp"))[0]
    data = bytearray(distcp.read_bytes())
    data[len(data) // 2] ^= 0x01
    distcp.write_bytes(bytes(data))
    assert distcp.stat().st_size == len(data)
    jm, opt = _run()
    with pytest.raises(FSDPError) as error:
        fsdp_pass.load_checkpoint(tmp_path, jm, opt)
    message = str(error.value)
    assert f"{distcp.name} has other contents than when it was saved (its sha256 differs" in message, message
    assert "newest checkpoint that verifies is" in message and "step=1" in message, message


def _as_if_saved_on_cuda(path: Path) -> None:
    """Rewrites a torch.save file as a CUDA process would have written it: its storages tagged cuda:0."""
    value = torch.load(path, weights_only=True)
    real = torch.serialization.location_tag
    torch.serialization.location_tag = lambda storage: "cuda:0"
    try:
        torch.save(value, path)
    finally:
        torch.serialization.location_tag = real


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a process without CUDA")
def test_a_checkpoint_saved_on_a_gpu_resumes_on_the_cpu_with_map_location(group, tmp_path):
    jm, opt = run = _run()
    state = torch.Generator().manual_seed(3).get_state()
    path = fsdp_pass.save_checkpoint(tmp_path, jm, opt, step=5, extra={"rng": state})
    _rewrite(path, "loop.pt", _as_if_saved_on_cuda)
    with pytest.raises(FSDPError) as error:
        load(tmp_path, run)
    message = str(error.value)
    assert "loop.pt holds tensors saved on a CUDA device" in message and "map_location='cpu'" in message, message
    assert "weights_only" not in message, message
    resumed = load(tmp_path, run, map_location="cpu")[0]
    assert resumed.extra["rng"].device.type == "cpu" and torch.equal(resumed.extra["rng"], state)


def _as_previous_format(folder: Path) -> None:
    """What fsdp_pass wrote before saves were numbered and extras per rank: loop.pt with step, extra and world
    size; a manifest (format 1) of every file the folder's listing held, without step, sequence or parent."""
    loop = torch.load(folder / "loop.pt", weights_only=True)
    torch.save({key: loop[key] for key in ("step", "extra", "world_size")}, folder / "loop.pt")
    files = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.name != "manifest.json":
            files[p.name] = {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps({"format": 1, "files": files}, indent=1, sort_keys=True))


def test_checkpoints_of_the_previous_format_load_and_come_before_new_saves(group, tmp_path):
    """Steps 8 and 12 in the previous format: step=None loads 12 (by step, as before); a rollback to 8 then a
    save of 10 sets 12 aside, and step 10, the first numbered save, is the newest."""
    first = _run()
    for step in (8, 12):
        _as_previous_format(save(tmp_path, first, step)[0])
    resumed, value, _ = load(tmp_path, _run())
    assert (resumed.step, resumed.extra, value) == (12, {"step": 12}, 12)
    rolled_back = _run()
    load(tmp_path, rolled_back, step=8)
    _, notes = save(tmp_path, rolled_back, 10, keep=2)
    assert steps(tmp_path) == [8, 10] and steps(tmp_path / "abandoned-1") == [12], notes
    assert load(tmp_path, _run())[0].step == 10 and _manifest(tmp_path / "step-00000010")["sequence"] == 1


def test_a_later_step_whose_manifest_is_gone_is_not_passed_over_silently(group, tmp_path):
    """Without its manifest a checkpoint has no known place in the sequence; step=None does not fall back to an
    older one past it, but names it and the newest that verifies."""
    run = _run()
    save(tmp_path, run, 4)
    path, _ = save(tmp_path, run, 8)
    (path / "manifest.json").unlink()
    with pytest.raises(FSDPError, match=r"step-00000008 is damaged: it has no manifest.json(.|\n)*verifies is .*"
                                        r"step-00000004(.|\n)*step=4"):
        load(tmp_path, _run())
