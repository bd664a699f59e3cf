"""The default units' measured step peak against one unit per block's and FSDP2's: the table of memory first.

    python -m bench.default_peak [--worlds 1,2] [--fusions auto,torchcompile] [--rows fsdp2,blocks,default]

The model is an HF Llama of d 256, 4 decoder layers, vocabulary 256 (``bench/configs/llama-d256``), 2 x 256 tokens
per rank, float32, one AdamW step; for each world size and lowering (``auto``: the CPU's executor list;
``torchcompile``: Thunder's torch.compile executor fusing the rest, as on a GPU) one ``python -m bench.gpu`` run
measures the rows (``fsdp2``: FSDP2 on each decoder layer, then the root; ``blocks``: ``FSDP("zero3",
units="blocks")``; ``default``: ``FSDP("zero3")``, the step model's units). The table gives each row's step peak
(bench.gpu's ``step peak``: one whole step's allocations above what lived before it, profiler replay, rank 0) and the
default's against the others. ``--rows default`` alone measures the default only (another checkout's, for a before
and after).
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys

from fsdp_pass.report.text import format_table

MODEL = "hf:bench/configs/llama-d256"
SYSTEM_OF = {"fsdp2": "fsdp2", "blocks": "ours zero3", "default": "ours zero3 default"}
MIB = 2**20


def measure(world: int, fusion: str, rows: list[str]) -> dict[str, int | str]:
    """Each row's step peak in bytes (or its error) from one bench.gpu run."""
    only = ",".join(SYSTEM_OF[r] for r in rows)
    argv = [sys.executable, "-m", "bench.gpu", "--device", "cpu", "--world", str(world), "--model", MODEL,
            "--seq", "256", "--batch", "2", "--steps", "1", "--warmup", "1", "--cost", "cpu-gloo",
            "--fusion", fusion, "--only", only]
    run = subprocess.run(argv, capture_output=True, text=True)
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
    args = p.parse_args(argv)
    rows = args.rows.split(",")
    table = []
    for world in map(int, args.worlds.split(",")):
        for fusion in args.fusions.split(","):
            peaks = measure(world, fusion, rows)
            print(f"[bench.default_peak] world {world} {fusion}: {peaks}", file=sys.stderr, flush=True)
            table.append((str(world), fusion, *(_mib(peaks[r]) for r in rows),
                          _ratio(peaks.get("default"), peaks.get("blocks")),
                          _ratio(peaks.get("default"), peaks.get("fsdp2"))))
    cols = ("world", "lowering", *(f"{r} MiB" for r in rows), "default / blocks", "default / fsdp2")
    print(f"step peak, {MODEL}, 2 x 256 tokens per rank, float32, AdamW (bench.gpu, rank 0)")
    print("\n".join(format_table(cols, table)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
