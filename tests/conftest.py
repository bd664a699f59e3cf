import pytest

from tests.rank_pool import RankPool, shutdown_all

_pools: dict[int, RankPool] = {}


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


def pytest_sessionfinish(session):
    shutdown_all(_pools.values())  # a pool started above that no test asked for (the fixture stops the others)


@pytest.fixture(scope="session")
def ranks():
    """``ranks(world_size)`` -> a persistent gloo RankPool of that size (restarted if it was killed)."""
    yield get_pool
    shutdown_all(_pools.values())
