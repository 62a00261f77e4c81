import pytest

from ringify.testing import RankPool

_pools: dict[int, RankPool] = {}


@pytest.fixture(scope="session")
def ranks():
    """``ranks(P)``: the session's reusable pool of P gloo ranks."""

    def get(world_size: int) -> RankPool:
        if world_size not in _pools:
            _pools[world_size] = RankPool(world_size)
        return _pools[world_size]

    yield get
    for pool in _pools.values():
        pool.close()
