"""A checkpoint folder's ``manifest.json``: which save it was (its step, its place in the folder's sequence of
saves, the checkpoint it went on from) and every file's size and sha256, written once the save is complete, and
checked before anything in the folder is unpickled or copied into a model. A folder without one is an
incomplete save (or an incomplete copy). Checkpoint folders sit on a file system every rank sees, so each file
is read by one rank, and the ranks share what they found: every rank reaches the same verdict.

``saved_files(metadata) -> [name]``: the files DCP wrote, from its ``Metadata`` (``storage_data``'s relative paths).

``file_digests(folder, names, group) -> {name: {"bytes": int, "sha256": str} | {"error": str}}`` (collective)
  1. Rank r of N reads the files ``names[r], names[r + N], ...``: its size and sha256, or the OSError.
  2. One ``all_gather_object``: every rank holds every file's digest.

``write_manifest(folder, digests, step=, sequence=, parent=)``: ``manifest.json`` (format 2) through a
temporary file, fsynced, and a rename (rank 0 calls it).

``manifest_sequence(folder) -> (sequence | None, readable)``: a complete checkpoint's place in the sequence;
None for one written before saves were numbered (format 1), or whose manifest cannot be read (readable False).

``damage(folder, group) -> (problem | None, files)`` (collective): what is wrong with the folder, the same on
every rank, and the files its manifest lists.
  1. Rank 0 reads ``manifest.json`` and sends it to every rank; a missing or unreadable one, or one that does
     not list the files read outside DCP's planner (``.metadata``, ``loop.pt``), is the problem.
  2. :func:`file_digests` of the files it lists; the first file, in name order, that is missing, of another
     size, or of another sha256 is the problem (with how many more differ).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch.distributed as dist

from fsdp_pass.train.loop_state import LOOP_FILE

MANIFEST_FILE = "manifest.json"
METADATA_FILE = ".metadata"  # torch.distributed.checkpoint's index of the folder (a pickle)
FORMAT = 2  # 1: no step, sequence or parent; its files were the folder's listing
_CHUNK = 8 << 20


def saved_files(metadata) -> list[str]:
    return sorted({info.relative_path for info in metadata.storage_data.values()})


def _digest(path: Path) -> dict:
    try:
        sha, size = hashlib.sha256(), 0
        with open(path, "rb") as f:
            while block := f.read(_CHUNK):
                sha.update(block)
                size += len(block)
        return {"bytes": size, "sha256": sha.hexdigest()}
    except OSError as e:
        return {"error": f"{type(e).__name__}: {e.strerror or e}"}


def file_digests(folder, names: list[str], group) -> dict[str, dict]:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = {name: _digest(Path(folder) / name) for name in names[rank::world]}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    found = {}
    for share in everyone:
        found.update(share)
    return {name: found[name] for name in names}


def write_manifest(folder, digests: dict[str, dict], *, step: int, sequence: int, parent: int | None) -> None:
    folder = Path(folder)
    temporary = folder / f".{MANIFEST_FILE}.tmp"
    record = {"format": FORMAT, "step": step, "sequence": sequence, "parent": parent, "files": digests}
    with open(temporary, "w") as f:
        f.write(json.dumps(record, indent=1, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, folder / MANIFEST_FILE)


def _load(folder: Path) -> tuple[dict | None, str | None]:
    path = folder / MANIFEST_FILE
    if not path.is_file():
        return None, (
            f"it has no {MANIFEST_FILE}: the save did not finish, the folder was copied in part, or an fsdp_pass "
            "older than checksummed checkpoints wrote it"
        )
    try:
        record = json.loads(path.read_text())
        return (record, None) if isinstance(record, dict) else (None, f"its {MANIFEST_FILE} is not a JSON object")
    except (OSError, ValueError) as e:
        return None, f"its {MANIFEST_FILE} cannot be read ({type(e).__name__}: {e})"


def manifest_sequence(folder) -> tuple[int | None, bool]:
    record, problem = _load(Path(folder))
    if problem is not None:
        return None, False
    sequence = record.get("sequence")
    return (sequence, True) if isinstance(sequence, int) else (None, record.get("format") == 1)


def _read_manifest(folder: Path) -> tuple[dict | None, str | None]:
    """(the files it lists, None) or (None, what is wrong with it)."""
    record, problem = _load(folder)
    if problem is not None:
        return None, problem
    try:
        files = record["files"]
        listed = all(isinstance(d["bytes"], int) and isinstance(d["sha256"], str) for d in files.values())
    except (KeyError, TypeError, AttributeError) as e:
        return None, f"its {MANIFEST_FILE} cannot be read ({type(e).__name__}: {e})"
    if not listed:
        return None, f"its {MANIFEST_FILE} does not give every file's bytes and sha256"
    unlisted = [name for name in (METADATA_FILE, LOOP_FILE) if name not in files]
    if unlisted:
        return None, f"its {MANIFEST_FILE} does not list {', '.join(unlisted)}"
    return files, None


def _file_problem(name: str, expected: dict, found: dict) -> str | None:
    if "error" in found:
        return f"{name} cannot be read ({found['error']})"
    if found["bytes"] != expected["bytes"]:
        how = "cut short" if found["bytes"] < expected["bytes"] else "longer"
        return f"{name} has {found['bytes']} bytes, {MANIFEST_FILE} says {expected['bytes']} ({how})"
    if found["sha256"] != expected["sha256"]:
        return f"{name} has other contents than when it was saved (its sha256 differs from {MANIFEST_FILE}'s)"
    return None


def damage(folder, group) -> tuple[str | None, list[str]]:
    folder = Path(folder)
    sent = list(_read_manifest(folder)) if dist.get_rank(group) == 0 else [None, None]
    dist.broadcast_object_list(sent, src=dist.get_global_rank(group, 0), group=group)
    files, problem = sent
    if problem is not None:
        return problem, []
    names = sorted(files)
    found = file_digests(folder, names, group)
    problems = [p for name in names if (p := _file_problem(name, files[name], found[name]))]
    if not problems:
        return None, names
    more = f" (and {len(problems) - 1} more file{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
    return problems[0] + more, names
