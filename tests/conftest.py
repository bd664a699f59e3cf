import shutil
import tempfile
import time
from pathlib import Path

import pytest

from tests.notebook_runner import BackgroundNotebooks
from tests.rank_pool import RankPool, shutdown_all
from tests.tracing_memos import install

install()  # a third less time in Thunder's interpreter (tests/tracing_memos.py); the ranks install it too

_pools: dict[int, RankPool] = {}
_notebooks: list[BackgroundNotebooks] = []


def get_pool(world_size: int) -> RankPool:
    pool = _pools.get(world_size)
    if pool is None or not pool.alive:
        pool = _pools[world_size] = RankPool(world_size)
    return pool


def _uses(item, fixture: str) -> bool:
    return fixture in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(session, config, items):
    """The order modules run in: first those whose tests all run in this process (they compute on one core,
    beside the notebooks started after collection, which compute mostly on the other), then, once the notebooks
    are done, those that use gloo ranks (every core busy), and last the notebook tests, which only read the
    results. A module's tests stay together and in their order (module fixtures compile once)."""
    kind: dict[str, int] = {}
    for item in items:
        key = item.nodeid.split("::")[0]
        here = 2 if _uses(item, "notebooks_in_background") else 1 if _uses(item, "ranks") else 0
        kind[key] = max(kind.get(key, 0), here)
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.nodeid.split("::")[0], i)
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda it: (kind[it.nodeid.split("::")[0]], first[it.nodeid.split("::")[0]], order[id(it)]))


def pytest_collection_finish(session):
    """When a collected test runs on gloo ranks, start the 2-rank pool now: its ranks import Thunder and join
    their group while the first tests run in this process, instead of when the first rank test asks for them."""
    if session.config.option.collectonly:
        return
    if any("ranks" in getattr(item, "fixturenames", ()) for item in session.items):
        get_pool(2)
    # the notebooks the session will test start running now, in a process of their own: their kernels compute
    # mostly on one core, beside this process's single-process tests, which leave the other one idle
    notebooks = list(dict.fromkeys(item.callspec.params["path"] for item in session.items  # each once, in order
                                   if "notebooks_in_background" in getattr(item, "fixturenames", ())))
    if notebooks:
        _notebooks.append(BackgroundNotebooks(notebooks, Path(tempfile.mkdtemp(prefix="fsdp_pass_notebooks_"))))


def pytest_runtest_setup(item):
    """Before the first test on gloo ranks, the notebooks are done: the ranks of a pool keep both cores busy, and
    a notebook beside them would take as long as the load made it (its limits are the machine's speed then)."""
    if _notebooks and _uses(item, "ranks") and _notebooks[0].rank_tests_started_at is None:
        _notebooks[0].wait_all()
        _notebooks[0].rank_tests_started_at = time.time()


def pytest_sessionfinish(session):
    shutdown_all(_pools.values())  # a pool started above that no test asked for (the fixture stops the others)
    for runner in _notebooks:
        runner.stop()
        shutil.rmtree(runner.results_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def ranks():
    """``ranks(world_size)`` -> a persistent gloo RankPool of that size (restarted if it was killed)."""
    yield get_pool
    shutdown_all(_pools.values())


@pytest.fixture(scope="session")
def notebooks_in_background():
    """The notebooks started after collection (``tests/notebook_runner.py``): ``.result_of(path)`` waits for one."""
    if not _notebooks:
        pytest.fail("no notebook runner was started after collection")
    return _notebooks[0]
