"""Where one compile of a tiny Hugging Face model goes: thunder.jit with FSDP zero3 on a one-rank gloo group, the
first step (the compile and its backward), by CPU time of this thread.

    python -m bench.compile_profile [--family llama] [--memos] [--cprofile N]

Prints the first step's CPU seconds and how many Python frames Thunder's interpreter ran, then a table of the
interpreted functions by own CPU time (the frames of the interpreter's own helper lambdas, e.g. the ``d[k]`` it
interprets for each global name, folded into the function that caused them; ``helper frames`` counts them).
``--memos`` installs the test session's memos (tests/tracing_memos.py) first; ``--cprofile N`` runs the step
under cProfile instead and prints its top N functions by cumulative and by own time (cProfile about doubles the
step's time).

What it showed (tiny GQA Llama, 1 layer, transformers 5.23.0, torch 2.11, Thunder 0.2.6, memos of the time
installed, machine load ~10): the first step 20-24 CPU s, of which Thunder's interpreter tracing the forward
~17.5 s and everything after it (Thunder's grad, remat, fusion, the pass's own passes, its planner and step
model) ~2.5 s; the backward 0.1-0.3 s. The interpreter ran 33,044 Python frames for a one-layer model, 26,494
of them its own helpers: each global name a traced function reads (6,640 of them) cost three interpreted frames
(``lambda d, k: d[k]``, the ``BINARY_SUBSCR`` it runs, ``obj.__getitem__(index)``) where one dictionary lookup
does; about half of the interpreter's time. Next, per transformers function: ``Module._call_impl`` (19 calls, 3 s
own time, mostly hook-dict globals), ``merge_with_config_defaults``'s wrapper (2.5 s), ``ModelOutput``'s
dataclass ``__init__``/``__post_init__``/``__setattr__`` and ``dataclasses.fields`` (4.3 s for two outputs).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import time
import warnings

import thunder
import torch
from fsdp_pass_executors import executors_for
from thunder.core import interpreter

from bench.recipe_parity import build_hf
from fsdp_pass import FSDP
from tests import tracing_memos
from tests.one_rank import one_rank

IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
THUNDER_HELPERS = "thunder/core/interpreter.py"


class FrameTimes:
    """Wraps the interpreter's entry into a Python frame: own and inclusive CPU time per traced function."""

    def __init__(self):
        self.own, self.inclusive = collections.Counter(), collections.Counter()
        self.calls, self.helpers = collections.Counter(), collections.Counter()
        self.frames, self._stack = 0, []
        self._run = interpreter._setup_frame_and_run_python_function

    def __enter__(self):
        interpreter._setup_frame_and_run_python_function = self._frame
        return self

    def __exit__(self, *exc):
        interpreter._setup_frame_and_run_python_function = self._run

    def _frame(self, compilectx, runtimectx, wrapped_fn, /, *args, **kwargs):
        self.frames += 1
        code = interpreter.unwrap(wrapped_fn).__code__
        if THUNDER_HELPERS in code.co_filename:
            if self._stack:
                self.helpers[self._stack[-1][0]] += 1
            return self._run(compilectx, runtimectx, wrapped_fn, *args, **kwargs)
        key = f"{code.co_filename.split('site-packages/')[-1]}:{code.co_firstlineno} {code.co_qualname}"
        self.calls[key] += 1
        entry = [key, time.thread_time(), 0.0]
        self._stack.append(entry)
        try:
            return self._run(compilectx, runtimectx, wrapped_fn, *args, **kwargs)
        finally:
            self._stack.pop()
            spent = time.thread_time() - entry[1]
            self.own[key] += spent - entry[2]
            if all(outer[0] != key for outer in self._stack):  # recursion counted once
                self.inclusive[key] += spent
            if self._stack:
                self._stack[-1][2] += spent

    def table(self, rows: int) -> str:
        lines = [f"{'own s':>7} {'incl s':>7} {'calls':>6} {'helper frames':>13}  function"]
        for key, own in self.own.most_common(rows):
            lines.append(f"{own:7.2f} {self.inclusive[key]:7.2f} {self.calls[key]:6d} {self.helpers[key]:13d}  {key}")
        return "\n".join(lines)


def first_step(family: str) -> float:
    """The first step's CPU seconds (this thread): the compile, then the backward."""
    jm = thunder.jit(build_hf(family, 1), transforms=[FSDP("zero3")], executors=executors_for("cpu"))
    start = time.thread_time()
    jm(input_ids=IDS, labels=IDS).loss.backward()
    return time.thread_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="llama")
    parser.add_argument("--memos", action="store_true")
    parser.add_argument("--cprofile", type=int, default=0)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.memos:
        tracing_memos.install()
    with one_rank():
        if args.cprofile:
            profile = cProfile.Profile()
            profile.runcall(first_step, args.family)
            for order in ("cumulative", "tottime"):
                pstats.Stats(profile).sort_stats(order).print_stats(args.cprofile)
            return
        with FrameTimes() as times:
            cpu = first_step(args.family)
    print(f"first step {cpu:.1f} CPU s, {times.frames} interpreted frames, "
          f"{sum(times.own.values()):.1f} s in traced functions' frames")
    print(times.table(30))


if __name__ == "__main__":
    main()
