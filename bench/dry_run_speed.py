"""How long a dry run takes and how much memory it holds: the zoo's Llama-2-7B, the same shape as a Hugging Face
config, and a Llama-2-70B-shaped Hugging Face config, side by side.

    .venv/bin/python -m bench.dry_run_speed                       # the three rows, ~2 minutes on 2 idle cores
    .venv/bin/python -m bench.dry_run_speed --only hf-7b --every-layer   # also with every layer interpreted

Each row is one ``python -m fsdp_pass explain`` in a process of its own (the configs are in ``bench/configs/``):

- ``zoo-7b``: ``--model llama2-7b --world-size 64 --strategy zero3``;
- ``hf-7b``: ``--model hf:bench/configs/llama2-7b --world-size 64 --strategy zero3``;
- ``hf-70b``: ``--model hf:bench/configs/llama2-70b --world-size 512 --strategy zero3 --param-dtype bfloat16``.

Columns: the wall time of the whole command (Python's start and the imports included), the CPU time it used
(user + system, the process and its children: less sensitive than the wall time to other work on the machine),
its largest resident memory, the compile time the command prints ("traced and lowered ... in N s"), and which
layers were copied rather than interpreted. ``--every-layer`` adds each row again with ``--every-layer`` (every
layer interpreted: the output is the same, only slower). The machine's load average is printed before and after:
compare figures taken under the same load.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fsdp_pass.text import format_table

CONFIGS = Path(__file__).parent / "configs"
ROWS = {
    "zoo-7b": ["--model", "llama2-7b", "--world-size", "64"],
    "hf-7b": ["--model", f"hf:{CONFIGS / 'llama2-7b'}", "--world-size", "64"],
    "hf-70b": ["--model", f"hf:{CONFIGS / 'llama2-70b'}", "--world-size", "512", "--param-dtype", "bfloat16"],
}
COMPILED = re.compile(r"traced and lowered as rank 0 of \d+.* in ([0-9.]+) s")
COPIED = re.compile(r"; (\d+ of \d+ layers of \S+ copied)")


def run_row(argv: list[str]) -> dict:
    """One dry run in a child process: its wall and CPU seconds, largest resident memory, printed compile time."""
    command = [sys.executable, "-m", "fsdp_pass", "explain", "--strategy", "zero3", *argv]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        child = subprocess.Popen(command, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own usage (ru_maxrss: KiB on Linux)
        wall = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        printed, errors = out.read(), err.read()
    if child.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({child.returncode}):\n{errors[-2000:]}")
    compiled, copied = COMPILED.search(printed), COPIED.search(printed)
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "rss": usage.ru_maxrss * 1024,
            "compile": float(compiled[1]) if compiled else None, "copied": copied[1] if copied else "none"}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.dry_run_speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(ROWS), help=f"rows, comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--every-layer", action="store_true", help="each row again with every layer interpreted")
    ns = p.parse_args(argv)
    names = [n.strip() for n in ns.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}: choose among {', '.join(ROWS)}")
    print(f"load average before: {_load()}", flush=True)
    table = []
    for name in names:
        for every in (False, True) if ns.every_layer else (False,):
            row = run_row(ROWS[name] + (["--every-layer"] if every else []))
            table.append([name + (" every layer" if every else ""), f"{row['wall']:.1f}", f"{row['cpu']:.1f}",
                          f"{row['rss'] / 2**30:.2f}", "-" if row["compile"] is None else f"{row['compile']:.1f}",
                          row["copied"]])
            print(f"  {table[-1][0]}: {table[-1][1]} s", flush=True)
    print(f"load average after: {_load()}")
    print("\n".join(format_table(["dry run", "wall s", "cpu s", "max RSS GiB", "compile s", "layers copied"], table)))


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
