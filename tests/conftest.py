import pytest

from ringify.testing import RankPool

_pools: dict[int, RankPool] = {}
HASH_SEEDS = [1, 3, 2, 4]  # 1 and 3 order {"full_attention", "sliding_attention"} differently


@pytest.fixture(scope="session")
def ranks():
    """``ranks(P)``: the session's reusable pool of P gloo ranks. Each rank has its own
    ``PYTHONHASHSEED``, as under torchrun (which leaves it unset): what a model does in
    ``set`` order, it does in another order on another rank."""

    def get(world_size: int) -> RankPool:
        if world_size not in _pools:
            _pools[world_size] = RankPool(world_size, hash_seeds=HASH_SEEDS[:world_size])
        return _pools[world_size]

    yield get
    for pool in _pools.values():
        pool.close()
