"""Tier 3: every notebook in notebooks/ runs top to bottom on CPU, and is committed without outputs.

Each notebook is executed by a Jupyter kernel running this interpreter (the test environment's python,
whatever kernelspecs are installed elsewhere), with the notebooks folder as its working directory. A
cell that raises fails the test with that cell's traceback.
"""

import sys
import time
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
SECONDS_PER_NOTEBOOK = 240


class _ThisInterpreter(KernelSpecManager):
    """Every kernel name resolves to an ipykernel on ``sys.executable``."""

    def get_kernel_spec(self, kernel_name):
        argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        return KernelSpec(argv=argv, display_name=f"Python ({sys.executable})", language="python")


def _code_cells(path: Path) -> list:
    return [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


def test_the_tutorials_are_there():
    names = [p.name for p in NOTEBOOKS]
    for prefix in ("00_", "01_", "02_", "03_", "04_", "05_"):
        assert any(n.startswith(prefix) for n in names), f"no notebooks/{prefix}*.ipynb (found {names})"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_without_outputs(path):
    dirty = [i for i, c in enumerate(_code_cells(path)) if c.outputs or c.execution_count is not None]
    assert not dirty, f"{path.name}: code cells {dirty} carry outputs or execution counts; strip them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(path):
    nb = nbformat.read(path, as_version=4)
    km = KernelManager(kernel_name="python3", kernel_spec_manager=_ThisInterpreter())
    client = NotebookClient(
        nb, km=km, timeout=SECONDS_PER_NOTEBOOK, resources={"metadata": {"path": str(NOTEBOOKS_DIR)}}
    )
    started = time.perf_counter()
    client.execute()  # raises CellExecutionError with the failing cell's traceback
    elapsed = time.perf_counter() - started
    assert elapsed < SECONDS_PER_NOTEBOOK, f"{path.name} took {elapsed:.0f} s"
