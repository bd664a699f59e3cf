"""The default units' measured step peak against one unit per block's and FSDP2's: the table of memory first.

    python -m bench.default_peak [--worlds 1,2] [--fusions auto,torchcompile] [--rows fsdp2,blocks,default]

The model is an HF Llama of d 256, 4 decoder layers, vocabulary 256 (``bench/configs/llama-d256``), 2 x 256 tokens
per rank, float32, one AdamW step; for each world size and lowering (``auto``: the CPU's executor list;
``torchcompile``: Thunder's torch.compile executor fusing the rest, as on a GPU) one ``python -m bench.gpu`` run
measures the rows (``fsdp2``: FSDP2 on each decoder layer, then the root; ``blocks``: ``FSDP("zero3",
units="blocks")``; ``default``: ``FSDP("zero3")``, the step model's units). The table gives each row's step peak
(bench.gpu's ``step peak``: one whole step's allocations above what lived before it, profiler replay, rank 0) and the
default's against the others. ``--checkout DIR`` runs another checkout's ``bench.gpu`` and package (its own
``.shim`` where it has one) on this one's model config: ``--checkout /path/to/main --rows default`` measures the default before a change.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
from pathlib import Path

from fsdp_pass.text import format_table

CONFIG = Path(__file__).resolve().parent / "configs" / "llama-d256"
MODEL = "hf:bench/configs/llama-d256"
SYSTEM_OF = {"fsdp2": "fsdp2", "blocks": "ours zero3", "default": "ours zero3 default"}
MIB = 2**20


def _environment(checkout: Path | None) -> dict[str, str]:
    """This process's environment; given a ``checkout``, its package and executors (its ``.shim`` where it has one,
    else the installed ones) in place of this process's path."""
    env = dict(os.environ)
    if checkout is not None:
        shim = checkout / ".shim"
        env["PYTHONPATH"] = os.pathsep.join([str(checkout), *([str(shim)] if shim.is_dir() else [])])
    return env


def measure(world: int, fusion: str, rows: list[str], checkout: Path | None = None) -> dict[str, int | str]:
    """Each row's step peak in bytes (or its error) from one bench.gpu run (``checkout``'s, where given)."""
    only = ",".join(SYSTEM_OF[r] for r in rows)
    argv = [sys.executable, "-m", "bench.gpu", "--device", "cpu", "--world", str(world), "--model", f"hf:{CONFIG}",
            "--seq", "256", "--batch", "2", "--steps", "1", "--warmup", "1", "--cost", "cpu-gloo",
            "--fusion", fusion, "--only", only]
    run = subprocess.run(argv, capture_output=True, text=True, cwd=checkout, env=_environment(checkout))
    found = {}
    for line in run.stderr.splitlines():
        if line.startswith("[bench.gpu] "):
            result = ast.literal_eval(line.removeprefix("[bench.gpu] "))
            found[result["name"]] = result.get("peak", result.get("error", "?"))
    return {r: found.get(SYSTEM_OF[r], f"no result (exit {run.returncode})") for r in rows}


def _mib(value) -> str:
    return f"{value / MIB:.1f}" if isinstance(value, int) else str(value)


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if isinstance(a, int) and isinstance(b, int) else "-"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", default="1,2")
    p.add_argument("--fusions", default="auto,torchcompile")
    p.add_argument("--rows", default="fsdp2,blocks,default")
    p.add_argument("--checkout", type=Path, default=None, help="measure another checkout's package (a before)")
    args = p.parse_args(argv)
    rows = args.rows.split(",")
    table = []
    for world in map(int, args.worlds.split(",")):
        for fusion in args.fusions.split(","):
            peaks = measure(world, fusion, rows, args.checkout)
            print(f"[bench.default_peak] world {world} {fusion}: {peaks}", file=sys.stderr, flush=True)
            table.append((str(world), fusion, *(_mib(peaks[r]) for r in rows),
                          _ratio(peaks.get("default"), peaks.get("blocks")),
                          _ratio(peaks.get("default"), peaks.get("fsdp2"))))
    cols = ("world", "lowering", *(f"{r} MiB" for r in rows), "default / blocks", "default / fsdp2")
    source = "" if args.checkout is None else f", the package of {args.checkout}"
    print(f"step peak, {MODEL}{source}, 2 x 256 tokens per rank, float32, AdamW (bench.gpu, rank 0)")
    print("\n".join(format_table(cols, table)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
