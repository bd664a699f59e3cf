"""Tier 3: every notebook in notebooks/ runs top to bottom on CPU, and is committed without outputs.

The notebooks run in a process of their own, started right after collection (``tests/notebook_runner.py``,
``tests/conftest.py``), beside the session's single-process tests and before its first test on gloo ranks; each
test here reads its notebook's result. A cell that raises fails the test with that cell's traceback.
"""

from pathlib import Path

import nbformat
import pytest

from tests.notebook_runner import SECONDS_PER_NOTEBOOK

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))


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
def test_notebook_runs_top_to_bottom(path, notebooks_in_background):
    result = notebooks_in_background.result_of(path)
    assert result["error"] is None, f"{path.name} stopped:\n{result['error']}"
    assert result["seconds"] < SECONDS_PER_NOTEBOOK, f"{path.name} took {result['seconds']:.0f} s"
    # it ran while no rank pool was at work: it finished before the session's first test on gloo ranks began
    started = notebooks_in_background.rank_tests_started_at
    assert started is None or result["finished_at"] <= started, (path.name, result["finished_at"], started)
