"""Execute notebooks top to bottom, one after the other, in a process of their own beside the test session; or
write their outputs into them.

    python -m tests.notebook_runner --write [NOTEBOOK ...]     # run them (default: all) and commit what they print
    python -m tests.notebook_runner RESULTS_DIR NOTEBOOK [NOTEBOOK ...]

Each notebook runs in a Jupyter kernel on this interpreter (the test environment's python, whatever
kernelspecs are installed elsewhere), with the notebooks folder as its working directory.

``--write`` puts each notebook's fresh outputs (text, tables, plots) into the notebook file itself: the
notebooks are committed with them, so they read without running. With a results folder, when one notebook is
done, ``RESULTS_DIR/<notebook name>.json`` holds ``{"error": traceback or null, "seconds": wall time,
"finished_at": time.time(), "executed": the executed copy's path}``, written whole (a rename), so a reader never
sees half a file; the executed copy is what ``tests/test_notebooks.py`` holds the committed outputs against
(:func:`differences`).

The test session starts it once, right after collection (``tests/conftest.py``): the notebooks' kernels
then compute on the core the session's own single-process tests leave idle; the first test on gloo ranks
waits until they are done (:func:`wait_all`), so a notebook never shares the cores with a rank pool at work.
Each notebook test only reads its result (:func:`result_of`).

A code cell whose first line starts with ``# timing-dependent output`` prints figures that depend on this machine's
speed and load (a measured step, a probe, how long something took): its text is compared with every figure masked
(:func:`shape_of`: each number with its unit, and the runs of spaces and dashes that align a table's columns), so
its rows, columns and words still are. A cell whose first line starts with ``# measured output, not compared:``
(then why) prints words that a measurement chooses (which plan was fastest, a fallback taken when a busy machine
cannot be measured): only the kinds of its outputs are compared.

No notebook is held to a wall-clock time: on a machine shared with other jobs the time measures the neighbours, and
the test suite's slowest tests are printed with their times. ``HANG_SECONDS`` only ends a notebook that is stuck.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

HANG_SECONDS = 1800  # a cell, a notebook: stuck, not slow (see the module docstring)


TIMING_MARK = "# timing-dependent output"
UNCOMPARED_MARK = "# measured output, not compared:"
# a figure: a number (sign, decimals, exponent, thousands) and the unit after it; a table's alignment
_FIGURE = re.compile(r"[-+]?\d[\d,]*(\.\d+)?(e[-+]?\d+)?( ?(%|x\b|[KMGT]i?B\b|B\b|[GT]?B/s|TFLOP/s|GFLOP/s|[mun]?s\b))?")
_ALIGNMENT = re.compile(r"[ \t]+|-{2,}")
NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
# Thunder's warning that an optional GPU executor is missing: noise in a committed notebook
_NOISE = re.compile(r"^.*transformer_engine module not found!.*\n(\s*warnings\.warn\(.*\n)?", re.M)


def execute(path: Path):
    """Run the notebook at ``path`` and return it with its outputs (consecutive prints of a cell joined into one
    output, Thunder's missing-executor warning left out); a cell that raises raises here (CellExecutionError,
    with its traceback)."""
    import nbformat
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    class ThisInterpreter(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            # ipykernel's launcher with tests/tracing_memos.py's memos installed first (a third less time tracing)
            argv = [sys.executable, str(Path(__file__).with_name("tracing_memos.py")), "-f", "{connection_file}"]
            return KernelSpec(argv=argv, display_name=f"Python ({sys.executable})", language="python")

    nb = nbformat.read(path, as_version=4)
    km = KernelManager(kernel_name="python3", kernel_spec_manager=ThisInterpreter())
    client = NotebookClient(nb, km=km, timeout=HANG_SECONDS, record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = _tidy(cell.outputs)
    return nb


def _tidy(outputs: list) -> list:
    out = []
    for o in outputs:
        if o.output_type == "stream":
            o.text = _NOISE.sub("", o.text) if o.name == "stderr" else o.text
            if not o.text:
                continue
            if out and out[-1].output_type == "stream" and out[-1].name == o.name:
                out[-1].text += o.text
                continue
        out.append(o)
    return out


def is_timing_dependent(cell) -> bool:
    return cell.source.lstrip().startswith(TIMING_MARK)


def is_uncompared(cell) -> bool:
    return cell.source.lstrip().startswith(UNCOMPARED_MARK)


def shape_of(text: str) -> str:
    """``text`` with each figure (a number and its unit) as ``#`` and each run of spaces or dashes as one: what a
    timing-dependent cell prints, whatever the machine measured."""
    return "\n".join(_ALIGNMENT.sub(" ", _FIGURE.sub("#", line)).strip() for line in text.splitlines())


def _compared(cell, text: str) -> str:
    if is_uncompared(cell):
        return ""
    return shape_of(text) if is_timing_dependent(cell) else text


def _printed(cell) -> list[tuple[str, str]]:
    """What a code cell showed, as compared: each output's kind, and its text (stdout, a result's plain text,
    an error), a timing-dependent cell's figures masked, none of an uncompared cell's; stderr and the pixels of
    plots are not compared."""
    shown = []
    for o in cell.outputs:
        if o.output_type == "stream":
            if o.name == "stdout":
                shown.append(("stdout", _compared(cell, o.text)))
        elif o.output_type == "error":
            shown.append(("error", o.ename))
        else:
            text = re.sub(r"0x[0-9a-f]+", "0x...", o.data.get("text/plain", ""))
            kinds = ",".join(sorted(k for k in o.data if k != "text/plain"))
            shown.append((f"{o.output_type} {kinds}", _compared(cell, text)))
    return shown


def differences(committed, fresh) -> list[str]:
    """How the committed notebook's outputs differ from a fresh run's, cell by cell (empty: they match)."""
    a = [c for c in committed.cells if c.cell_type == "code"]
    b = [c for c in fresh.cells if c.cell_type == "code"]
    if [c.source for c in a] != [c.source for c in b]:
        return ["the code cells differ from those that ran"]
    out = []
    for i, (ca, cb) in enumerate(zip(a, b)):
        pa, pb = _printed(ca), _printed(cb)
        if pa == pb:
            continue
        first = ca.source.splitlines()[0] if ca.source else ""
        if [k for k, _ in pa] != [k for k, _ in pb]:
            out.append(f"code cell {i} ({first!r}): committed outputs {[k for k, _ in pa]}, a fresh run shows "
                       f"{[k for k, _ in pb]}")
            continue
        for (kind, ta), (_, tb) in zip(pa, pb):
            if ta != tb:
                diff = difflib.unified_diff(ta.splitlines(), tb.splitlines(), "committed", "fresh run", lineterm="", n=1)
                out.append(f"code cell {i} ({first!r}), {kind}:\n" + "\n".join(list(diff)[:40]))
    return out


def write(paths: list[Path]) -> None:
    """Run each notebook and write its outputs into it."""
    import nbformat

    for path in paths:
        started = time.perf_counter()
        nb = execute(path)
        nbformat.write(nb, path)
        print(f"{path.name}: {time.perf_counter() - started:.0f} s, outputs written", flush=True)


def _result_path(results_dir: Path, notebook: Path) -> Path:
    return results_dir / f"{notebook.name}.json"


def main(argv: list[str]) -> int:
    if argv[:1] == ["--write"]:
        write([Path(p) for p in argv[1:]] or sorted(NOTEBOOKS_DIR.glob("*.ipynb")))
        return 0
    import nbformat

    results_dir, notebooks = Path(argv[0]), [Path(p) for p in argv[1:]]
    for path in notebooks:
        started = time.perf_counter()
        executed = results_dir / path.name
        try:
            nbformat.write(execute(path), executed)
            error = None
        except BaseException:  # noqa: BLE001 - the test reports whatever stopped the notebook
            error = traceback.format_exc()
        out = _result_path(results_dir, path)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"error": error, "seconds": time.perf_counter() - started, "finished_at": time.time(),
                                   "executed": str(executed)}))
        os.replace(tmp, out)
    return 0


class BackgroundNotebooks:
    """The runner process over ``notebooks``, started now; :meth:`result_of` waits for one notebook's result."""

    def __init__(self, notebooks: list[Path], results_dir: Path):
        self.notebooks, self.results_dir = list(notebooks), results_dir
        self.rank_tests_started_at: float | None = None  # time.time() when the session's first rank test began
        self.log = results_dir / "runner.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.notebook_runner", str(results_dir), *map(str, notebooks)],
                cwd=Path(__file__).resolve().parent.parent, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,  # its kernels with it: stop() ends the whole group
            )

    def result_of(self, notebook: Path) -> dict:
        """``{"error": ..., "seconds": ...}`` of ``notebook`` once it has run; an AssertionError when the runner
        stopped without it, or when it is still not done once every notebook up to it could have hung (a stuck
        runner, not a slow one)."""
        out = _result_path(self.results_dir, notebook)
        deadline = time.monotonic() + HANG_SECONDS * (self.notebooks.index(notebook) + 1) + 60
        while not out.exists():
            if self.proc.poll() is not None and not out.exists():
                raise AssertionError(f"the notebook runner stopped before {notebook.name}:\n{self.log.read_text()}")
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"{notebook.name} has no result after its time ran out:\n{self.log.read_text()}")
            time.sleep(0.5)
        return json.loads(out.read_text())

    def wait_all(self) -> None:
        """Return once the runner is done with every notebook, or once the time they may all take has run out
        (then :meth:`result_of` reports the notebooks left without a result)."""
        try:
            self.proc.wait(timeout=HANG_SECONDS * len(self.notebooks) + 60)
        except subprocess.TimeoutExpired:
            self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
