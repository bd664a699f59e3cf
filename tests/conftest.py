import shutil
import tempfile
from pathlib import Path

import pytest

from tests.notebook_runner import BackgroundNotebooks
from tests.rank_pool import RankPool, shutdown_all

_pools: dict[int, RankPool] = {}
_notebooks: list[BackgroundNotebooks] = []


def get_pool(world_size: int) -> RankPool:
    pool = _pools.get(world_size)
    if pool is None or not pool.alive:
        pool = _pools[world_size] = RankPool(world_size)
    return pool


def pytest_collection_finish(session):
    """When a collected test runs on gloo ranks, start the 2-rank pool now: its ranks import Thunder and join
    their group while the first tests run in this process, instead of when the first rank test asks for them."""
    if session.config.option.collectonly:
        return
    if any("ranks" in getattr(item, "fixturenames", ()) for item in session.items):
        get_pool(2)
    # the notebooks the session will test start running now, in a process of their own: their kernels compute
    # mostly on one core, beside this process's single-process tests, which leave the other one idle
    notebooks = [item.callspec.params["path"] for item in session.items
                 if "notebooks_in_background" in getattr(item, "fixturenames", ())]
    if notebooks:
        _notebooks.append(BackgroundNotebooks(notebooks, Path(tempfile.mkdtemp(prefix="fsdp_pass_notebooks_"))))


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
