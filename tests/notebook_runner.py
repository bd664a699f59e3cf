"""Execute notebooks top to bottom, one after the other, in a process of their own beside the test session.

    python -m tests.notebook_runner RESULTS_DIR NOTEBOOK [NOTEBOOK ...]

Each notebook runs in a Jupyter kernel on this interpreter (the test environment's python, whatever
kernelspecs are installed elsewhere), with the notebooks folder as its working directory. When one is done,
``RESULTS_DIR/<notebook name>.json`` holds ``{"error": traceback or null, "seconds": wall time, "finished_at":
time.time()}``, written whole (a rename), so a reader never sees half a file.

The test session starts it once, right after collection (``tests/conftest.py``): the notebooks' kernels
then compute on the core the session's own single-process tests leave idle; the first test on gloo ranks
waits until they are done (:func:`wait_all`), so a notebook never shares the cores with a rank pool at work.
Each notebook test only reads its result (:func:`result_of`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

SECONDS_PER_NOTEBOOK = 240


def execute(path: Path) -> None:
    """Run the notebook at ``path``; a cell that raises raises here (CellExecutionError, with its traceback)."""
    import nbformat
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    class ThisInterpreter(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
            return KernelSpec(argv=argv, display_name=f"Python ({sys.executable})", language="python")

    nb = nbformat.read(path, as_version=4)
    km = KernelManager(kernel_name="python3", kernel_spec_manager=ThisInterpreter())
    client = NotebookClient(nb, km=km, timeout=SECONDS_PER_NOTEBOOK, resources={"metadata": {"path": str(path.parent)}})
    client.execute()


def _result_path(results_dir: Path, notebook: Path) -> Path:
    return results_dir / f"{notebook.name}.json"


def main(argv: list[str]) -> int:
    results_dir, notebooks = Path(argv[0]), [Path(p) for p in argv[1:]]
    for path in notebooks:
        started = time.perf_counter()
        try:
            execute(path)
            error = None
        except BaseException:  # noqa: BLE001 - the test reports whatever stopped the notebook
            error = traceback.format_exc()
        out = _result_path(results_dir, path)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"error": error, "seconds": time.perf_counter() - started, "finished_at": time.time()}))
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
        stopped without it, or when it is not done within the time every notebook before it may take."""
        out = _result_path(self.results_dir, notebook)
        deadline = time.monotonic() + SECONDS_PER_NOTEBOOK * (self.notebooks.index(notebook) + 1) + 60
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
            self.proc.wait(timeout=SECONDS_PER_NOTEBOOK * len(self.notebooks) + 60)
        except subprocess.TimeoutExpired:
            self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
