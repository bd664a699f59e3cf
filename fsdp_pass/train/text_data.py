"""Byte-level text for the training loop: a corpus read from files, a held-out split, and batches that depend
only on ``(seed, step)``.

``load_corpus(path=None, val_fraction=0.05) -> TextCorpus``; ``train_windows(corpus, global_batch, seq, seed,
step)``; ``val_windows(corpus, count, seq)``; ``rank_slice(windows, rank, world)``.

1. **Reading.** ``path`` is a file, or a folder whose files (every regular file below it, hidden ones left out)
   are read in sorted order of their paths; without a path, the standard library's own top-level ``*.py``
   files (``sysconfig.get_paths()["stdlib"]``, sorted): a corpus every machine with Python has, about 4.7 MB
   on CPython 3.11. The files' bytes are joined as they are, one after another: a token is a byte, so the
   vocabulary is :data:`BYTE_VOCAB` (256) whatever the text's encoding.
2. **The split.** The last ``val_fraction`` of the bytes is held out for validation; training never reads it.
3. **Training windows.** A step's global batch is ``global_batch`` windows of ``seq + 1`` bytes of the
   training part (inputs and their next bytes), starting at offsets drawn from a generator seeded by
   ``(seed, step)`` alone. So the global batch of a step is the same at any world size, and a run resumed
   at step ``s`` draws what the uninterrupted run drew at ``s``; each rank takes its contiguous slice
   (``rank_slice``).
4. **Validation windows.** ``count`` windows spaced evenly over the held-out part, from its first byte to
   its last full window: the same windows at every evaluation, so validation losses compare across steps.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from fsdp_pass.errors import check

BYTE_VOCAB = 256
DEFAULT_VAL_FRACTION = 0.05


@dataclass(frozen=True)
class TextCorpus:
    """The bytes of a corpus as uint8 tensors: ``train`` then ``val`` (the held-out tail), and where they came from."""

    train: torch.Tensor
    val: torch.Tensor
    source: str
    files: int

    def describe(self) -> str:
        return (
            f"{self.source}: {self.files} file{'s' if self.files != 1 else ''}, "
            f"{len(self.train) + len(self.val):,} bytes ({len(self.train):,} train, {len(self.val):,} held out)"
        )


def default_corpus_files() -> list[Path]:
    """The standard library's top-level ``*.py`` files, sorted by name."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def corpus_files(path: str | Path | None) -> list[Path]:
    """The files a corpus is read from, in order: ``path`` itself, the regular files below the folder ``path``
    (none under a hidden name), or :func:`default_corpus_files`."""
    if path is None:
        return default_corpus_files()
    root = Path(path).expanduser()
    check(root.exists(), lambda: f"--data {path}: there is no such file or folder.",
          "Give a text file or a folder of them.")
    if root.is_file():
        return [root]
    visible = (f for f in root.rglob("*") if not any(part.startswith(".") for part in f.relative_to(root).parts))
    return sorted(f for f in visible if f.is_file())


def load_corpus(path: str | Path | None = None, val_fraction: float = DEFAULT_VAL_FRACTION) -> TextCorpus:
    """The bytes of ``path`` (see :func:`corpus_files`), split into training bytes and the held-out tail."""
    check(
        0 < val_fraction < 1,
        lambda: f"A held-out fraction of {val_fraction} leaves nothing to train on or nothing to validate on.",
        "Pass a fraction between 0 and 1, e.g. 0.05.",
    )
    files = corpus_files(path)
    data = b"".join(f.read_bytes() for f in files)
    source = str(path) if path is not None else f"the standard library's *.py ({sysconfig.get_paths()['stdlib']})"
    check(len(data) > 0, lambda: f"{source} holds no bytes to train on.", "Give a non-empty text file or folder.")
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    cut = len(tokens) - max(1, round(len(tokens) * val_fraction))
    return TextCorpus(train=tokens[:cut], val=tokens[cut:], source=source, files=len(files))


def _windows(tokens: torch.Tensor, starts: torch.Tensor, seq: int) -> torch.Tensor:
    """``(len(starts), seq + 1)`` int64 token windows starting at ``starts``."""
    return tokens[starts[:, None] + torch.arange(seq + 1)].long()


def _check_fits(tokens: torch.Tensor, seq: int, part: str) -> None:
    check(
        len(tokens) >= seq + 1,
        lambda: f"The {part} part of the corpus has {len(tokens):,} bytes, fewer than one window of {seq + 1} "
        f"(--seq {seq} and the byte after it).",
        "Give more text (--data), a shorter --seq, or another held-out fraction.",
    )


def _generator(seed: int, step: int) -> torch.Generator:
    """A generator seeded by ``(seed, step)``: the pair hashed to the 32 bits torch's CPU generator keeps of a seed
    (it drops the higher ones, so ``seed * 2**32 + step`` would ignore the seed)."""
    digest = hashlib.blake2b(f"{seed},{step}".encode(), digest_size=4).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


def train_windows(corpus: TextCorpus, global_batch: int, seq: int, seed: int, step: int) -> torch.Tensor:
    """The global batch of ``step``: ``(global_batch, seq + 1)`` windows of the training bytes at offsets drawn
    from a generator seeded by ``(seed, step)`` alone (item 3 of the module's docstring)."""
    _check_fits(corpus.train, seq, "training")
    starts = torch.randint(0, len(corpus.train) - seq, (global_batch,), generator=_generator(seed, step))
    return _windows(corpus.train, starts, seq)


def val_windows(corpus: TextCorpus, count: int, seq: int) -> torch.Tensor:
    """``(count, seq + 1)`` windows spaced evenly over the held-out bytes, the same at every call."""
    _check_fits(corpus.val, seq, "held-out")
    starts = torch.linspace(0, len(corpus.val) - seq - 1, count).round().long()
    return _windows(corpus.val, starts, seq)


def rank_slice(windows: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous share of a global batch whose rows split evenly over ``world`` ranks."""
    check(
        len(windows) % world == 0,
        lambda: f"A batch of {len(windows)} sequences does not split evenly over {world} ranks.",
        "Pick a global batch that is a multiple of the world size.",
    )
    per_rank = len(windows) // world
    return windows[rank * per_rank : (rank + 1) * per_rank]
