"""Each rank's ``extra`` in a checkpoint: written once where every rank passed the same, per rank where they
differ (a data loader's position, a random generator's state), and the rule that gives each rank its own back.

``value_digest(value) -> str``: a sha256 of an accepted value (:func:`~.loop_state.refused_part`), equal for equal
values (tensors bitwise: dtype, shape and bytes; dicts and sets whatever their order), so ranks compare their
extras by sending 64 characters. ``first_difference(a, b) -> str | None``: where two first differ
(``extra['data']['offset']``).

``extra_digests(extra, group) -> [sha256 by rank]`` (collective): an extra that would not load back is an
FSDPError on every rank naming its path and type; then every rank's digest, on every rank.

``write_rank_extras(folder, extra, digests, group)`` (collective): where the digests differ, each rank writes its
own to ``extra-0000r.pt`` (fsynced); where they are equal, ``loop.pt`` holds the one extra.

``extra_of_this_rank(folder, loop, files, per_rank_extra, map_location, group)`` (collective), the rule:
  1. One extra saved (equal on every rank, or a checkpoint written before extras were per rank): every rank
     gets it, at any world size (``per_rank_extra="all"``: a list of it, one per saved rank).
  2. Extras that differed, loaded at the world size that saved them: rank r gets rank r's.
  3. At another world size no rank's extra is its own: an FSDPError naming the first difference, unless
     ``per_rank_extra="all"``: every rank gets the list of every saved rank's extra, by saved rank, to map.
  A per-rank file the verified manifest does not list, or one that cannot be read (``map_location`` given to
  ``torch.load``), is an FSDPError on every rank.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_pass.errors import check, check_on_all_ranks, fail, first_problem, value_from_rank0
from fsdp_pass.train.checkpoint_manifest import MANIFEST_FILE
from fsdp_pass.train.loop_state import MAPPINGS, describe, rank_extra_file, read_value, refused_part, write_value

PER_RANK_EXTRA = ("own", "all")


def _canonical(value) -> bytes:
    """Bytes equal for equal accepted values (tensors bitwise), whatever the order of a dict's or a set's items."""
    kind = describe(value).encode()
    if isinstance(value, torch.Tensor):
        dense = value.detach().cpu()
        dense = dense if dense.layout == torch.strided else dense.to_dense()  # a sparse tensor, by its values
        data = dense.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        return kind + repr((value.dtype, value.layout, tuple(value.shape))).encode() + hashlib.sha256(data).digest()
    if isinstance(value, MAPPINGS):
        items = sorted(hashlib.sha256(_canonical(k)).digest() + hashlib.sha256(_canonical(v)).digest()
                       for k, v in value.items())
        return kind + b"{" + b"".join(items) + b"}"
    if isinstance(value, set):
        return kind + b"{" + b"".join(sorted(hashlib.sha256(_canonical(v)).digest() for v in value)) + b"}"
    if isinstance(value, (list, tuple)):  # torch.Size too
        return kind + b"[" + b"".join(hashlib.sha256(_canonical(v)).digest() for v in value) + b"]"
    return kind + repr(value).encode()


def value_digest(value) -> str:
    return hashlib.sha256(_canonical(value)).hexdigest()


def first_difference(a, b, path: str = "extra") -> str | None:
    if value_digest(a) == value_digest(b):
        return None
    if type(a) is not type(b) or not isinstance(a, (*MAPPINGS, list, tuple)) or len(a) != len(b):
        return path
    if isinstance(a, MAPPINGS):
        if {value_digest(k) for k in a} != {value_digest(k) for k in b}:
            return f"the keys of {path}"
        pairs = [(a[k], b[k], f"{path}[{k!r}]") for k in a]
    else:
        pairs = [(x, y, f"{path}[{i}]") for i, (x, y) in enumerate(zip(a, b))]
    return next((found for x, y, p in pairs if (found := first_difference(x, y, p))), path)




def extra_digests(extra, group) -> list[str]:
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
    digests = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, value_digest(extra), group=group)
    return digests


def write_rank_extras(folder: Path, extra, digests: list[str], todo: str, group) -> list[str]:
    """The names of the files written (none where every rank's extra is the same)."""
    if len(set(digests)) == 1:
        return []
    rank, problem = dist.get_rank(group), None
    try:
        write_value(folder / rank_extra_file(rank), extra)
    except OSError as e:
        problem = f"rank {rank} could not write its extra ({type(e).__name__}: {e})"
    check_on_all_ranks(problem, todo, group)
    return [rank_extra_file(r) for r in range(len(digests))]


def _check_read(problem: tuple[str, str] | None, folder: Path, group) -> None:
    problem = first_problem(problem, group)
    check(problem is None, lambda: f"The checkpoint {folder} cannot be loaded: {problem[0]}. Nothing was loaded.",
          problem[1] if problem else "")


def _differing(folder: Path, digests: list[str], map_location, world: int) -> str:
    other = next(r for r, d in enumerate(digests) if d != digests[0])
    (first, bad), (second, bad_too) = (read_value(folder / rank_extra_file(r), map_location) for r in (0, other))
    where = "extra" if bad or bad_too else first_difference(first, second)
    return (
        f"The checkpoint {folder} was saved by {len(digests)} ranks whose extras differ ({where} on rank {other} "
        f"differs from rank 0's): at the world size that saved them each rank loads its own, but at world size "
        f"{world} no rank's extra is its own. Nothing was loaded."
    )


def extra_of_this_rank(folder: Path, loop: dict, files: list[str], per_rank_extra: str, map_location, group):
    digests, saved_world = loop.get("extra_digests"), loop.get("world_size", 1)
    if digests is None or len(set(digests)) == 1:  # 1. one extra, for every rank
        return loop["extra"] if per_rank_extra == "own" else [loop["extra"]] * saved_world
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if per_rank_extra == "own" and world != len(digests):  # 3.
        what = value_from_rank0(lambda: _differing(folder, digests, map_location, world), "Load another step.", group)
        fail(what, f"Resume at world size {len(digests)}, or pass per_rank_extra='all' to load_checkpoint(): "
             f"Resumed.extra is then the list of the {len(digests)} saved ranks' extras, by rank, to map onto "
             f"{world} ranks yourself (a data loader's position; random generators to reseed).")
    names = [rank_extra_file(rank)] if per_rank_extra == "own" else [rank_extra_file(r) for r in range(len(digests))]
    unlisted = next((name for name in names if name not in files), None)
    read = [read_value(folder / name, map_location) for name in names] if unlisted is None else []
    problem = (f"its {MANIFEST_FILE} does not list {unlisted}", "Load another step.") if unlisted else next(
        (p for _, p in read if p is not None), None)
    _check_read(problem, folder, group)
    return read[0][0] if per_rank_extra == "own" else [value for value, _ in read]
