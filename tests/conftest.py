import inspect
import os

import pytest
import torch

from ringify.testing import RankPool

_pools: dict[int, RankPool] = {}
HASH_SEEDS = [1, 3, 2, 4]  # 1 and 3 order {"full_attention", "sliding_attention"} differently


def pytest_configure(config):
    """Strict mode (``ringify.passes.graph.report.strict``): a rule of ringify's that raises
    fails its test instead of being gathered as a defect the report names.

    torch's first multithreaded float64 ``exp`` in a process is sometimes 1e-9 off (2 in 30
    fresh processes on this machine's 2 threads; never with one thread, as rank processes
    run, nor after a first call): float64 results here are compared to 1e-10, so the first
    call is made before any test."""
    os.environ["RINGIFY_STRICT"] = "1"  # inherited by the rank processes the tests spawn
    for dtype in (torch.float64, torch.float32):
        torch.zeros(1 << 16, dtype=dtype).exp().log()


# parameters that vary how a case runs, not which model code it runs
_HOW = frozenset({"world", "ring", "ring_size", "layout", "backend", "compiled", "tiles", "dtype"})


def pytest_addoption(parser):
    parser.addoption(
        "--each-model-once",
        action="store_true",
        help="keep one eager case of each test per model and input (the first world size "
        "and layout): CI's pass on the oldest transformers, which checks that the models' "
        "code still reads, not the ring again",
    )


def pytest_collection_modifyitems(config, items):
    """Mark ``hf`` every test of a module that runs HF transformers code: CI runs those again
    against the oldest transformers the project supports (``.ci/run``). Mark ``slow`` every
    test compiled with Inductor: on a fresh machine each compiles C++ for half a minute or
    more, and its graphs are the aot_eager tests' (CI runs them in a pass of their own);
    but for one case per strategy, marked ``inductor_default``, which the default pass keeps:
    Inductor is the compiler users run."""
    uses: dict[str, bool] = {}
    for item in items:
        module = item.module
        if module.__name__ not in uses:
            source = inspect.getsource(module)
            uses[module.__name__] = "transformers" in source or "hf_models" in source
        if uses[module.__name__]:
            item.add_marker(pytest.mark.hf)
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "inductor" in params.values() and not item.get_closest_marker("inductor_default"):
            item.add_marker(pytest.mark.slow)
    if config.getoption("--each-model-once"):
        kept, seen = [], set()
        for item in items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            key = (item.nodeid.split("[")[0], repr(sorted(
                (k, v) for k, v in params.items() if k not in _HOW
            )))  # fmt: skip
            compiled = any(v in ("aot_eager", "inductor") for v in params.values())
            if key not in seen and not compiled:
                seen.add(key)
                kept.append(item)
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept


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
