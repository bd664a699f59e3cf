import pytest

from tests.rank_pool import RankPool, shutdown_all

_pools: dict[int, RankPool] = {}


def get_pool(world_size: int) -> RankPool:
    pool = _pools.get(world_size)
    if pool is None or not pool.alive:
        pool = _pools[world_size] = RankPool(world_size)
    return pool


@pytest.fixture(scope="session")
def ranks():
    """``ranks(world_size)`` -> a persistent gloo RankPool of that size (restarted if it was killed)."""
    yield get_pool
    shutdown_all(_pools.values())
