"""Tier 3: every notebook in notebooks/ runs top to bottom on CPU, and is committed with the outputs it prints.

The notebooks run in a process of their own, started right after collection (``tests/notebook_runner.py``,
``tests/conftest.py``), beside the session's single-process tests and before its first test on gloo ranks; each
test here reads its notebook's result. A cell that raises fails the test with that cell's traceback. That same
run's executed copy is held against the committed notebook: every code cell shows the same kinds of output
(prints, results, plots) and the same printed text; a cell marked ``# timing-dependent output`` the same text with
its measured figures masked, a cell marked ``# measured output, not compared:`` (words a measurement chooses) the
same kinds of output only (tests/notebook_runner.py). No notebook is held to a wall-clock time: on this shared
machine it measures the load. ``python -m tests.notebook_runner --write`` brings the committed outputs up to date.
"""

from pathlib import Path

import nbformat
import pytest

from tests.notebook_runner import differences, is_timing_dependent, is_uncompared, shape_of

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
    assert any(not is_timing_dependent(c) and not is_uncompared(c) and c.outputs for c in cells), (
        f"{path.name}: every cell timing-dependent")
    # a cell left uncompared says why; at most one in four is
    assert all(c.source.splitlines()[0].split(":", 1)[1].strip() for c in cells if is_uncompared(c)), path.name
    assert 4 * sum(map(is_uncompared, cells)) <= len(cells), path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(path, notebooks_in_background):
    result = notebooks_in_background.result_of(path)
    assert result["error"] is None, f"{path.name} stopped:\n{result['error']}"
    # it ran while no rank pool was at work: it finished before the session's first test on gloo ranks began
    started = notebooks_in_background.rank_tests_started_at
    assert started is None or result["finished_at"] <= started, (path.name, result["finished_at"], started)


def test_a_timing_cell_is_compared_on_its_shape():
    """Its figures (numbers and their units, a table's alignment) masked, its rows, columns and words kept."""
    ran = "schedule     step\n-----------  --------\nprefetch=1   92.47 ms\n2 of 10 exposed, 1.2 MiB, 25%\n"
    again = "schedule     step\n-----------  ---------\nprefetch=1   113.08 s\n3 of 10 exposed, 640.0 KiB, 5%\n"
    assert shape_of(ran) == shape_of(again) == "schedule step\n\nprefetch=# #\n# of # exposed, #, #"
    assert shape_of(ran) != shape_of(ran.replace("prefetch=1", "prefetch=0 (default)"))
    assert shape_of(ran) != shape_of(ran.replace("exposed", "hidden"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_outputs_match_a_fresh_run(path, notebooks_in_background):
    result = notebooks_in_background.result_of(path)
    if result["error"] is not None:
        pytest.skip("the notebook stopped (test_notebook_runs_top_to_bottom says where)")
    fresh = nbformat.read(result["executed"], as_version=4)
    found = differences(nbformat.read(path, as_version=4), fresh)
    assert not found, (f"{path.name}: the committed outputs are not what it prints now "
                       "(python -m tests.notebook_runner --write brings them up to date):\n" + "\n".join(found))
