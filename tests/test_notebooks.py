"""Tier 3: every notebook in notebooks/ runs top to bottom on CPU, and is committed with the outputs it prints.

The notebooks run in a process of their own, started right after collection (``tests/notebook_runner.py``,
``tests/conftest.py``), beside the session's single-process tests and before its first test on gloo ranks; each
test here reads its notebook's result. A cell that raises fails the test with that cell's traceback. That same
run's executed copy is held against the committed notebook: every code cell shows the same kinds of output
(prints, results, plots) and the same printed text, except a cell marked ``# timing-dependent output`` (its
text is not compared). ``python -m tests.notebook_runner --write`` brings the committed outputs up to date.
"""

from pathlib import Path

import nbformat
import pytest

from tests.notebook_runner import SECONDS_PER_NOTEBOOK, differences, is_timing_dependent

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))


def _code_cells(path: Path) -> list:
    return [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


def test_the_tutorials_are_there():
    names = [p.name for p in NOTEBOOKS]
    for prefix in ("00_", "01_", "02_", "03_", "04_", "05_"):
        assert any(n.startswith(prefix) for n in names), f"no notebooks/{prefix}*.ipynb (found {names})"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_with_outputs(path):
    cells = _code_cells(path)
    assert any(c.outputs for c in cells), f"{path.name}: no outputs; run python -m tests.notebook_runner --write"
    assert any(not is_timing_dependent(c) and c.outputs for c in cells), f"{path.name}: every cell timing-dependent"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(path, notebooks_in_background):
    result = notebooks_in_background.result_of(path)
    assert result["error"] is None, f"{path.name} stopped:\n{result['error']}"
    assert result["seconds"] < SECONDS_PER_NOTEBOOK, f"{path.name} took {result['seconds']:.0f} s"
    # it ran while no rank pool was at work: it finished before the session's first test on gloo ranks began
    started = notebooks_in_background.rank_tests_started_at
    assert started is None or result["finished_at"] <= started, (path.name, result["finished_at"], started)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_outputs_match_a_fresh_run(path, notebooks_in_background):
    result = notebooks_in_background.result_of(path)
    if result["error"] is not None:
        pytest.skip("the notebook stopped (test_notebook_runs_top_to_bottom says where)")
    fresh = nbformat.read(result["executed"], as_version=4)
    found = differences(nbformat.read(path, as_version=4), fresh)
    assert not found, (f"{path.name}: the committed outputs are not what it prints now "
                       "(python -m tests.notebook_runner --write brings them up to date):\n" + "\n".join(found))
