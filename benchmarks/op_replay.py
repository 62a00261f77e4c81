"""The ring ops' calls of one training step, captured and replayed on their own.

Within a step on this CPU, the model's own ops compute for real between the ring op's calls
(the ring op's stubs do not): they evict the host's caches, and the ring op's Python then
runs up to twice as slowly, by an amount that depends on the model and not on the op. A
GPU's host launches those ops and never touches their data. So each call is also measured
replayed: the step's calls, with the arguments they had, run back to back under no
autograd, one rank at a time (their exchanges are stubbed: nothing waits for another rank;
and four ranks on this machine's two cores would time the scheduler); the same for
``is_causal`` and every mask case, as PyTorch's ring is measured (a loop of its calls).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

OPS = {"ringify::ring_attention": "ring_attention_op",
       "ringify::ring_attention_backward": "ring_attention_backward_op"}  # fmt: skip


def captured_calls(step: Callable[[], None]) -> dict[str, list[tuple[tuple, dict]]]:
    """The arguments of every ring op call of one ``step``, by op name, in order."""
    from ringify.runtime.attention import ops

    calls: dict[str, list] = {name: [] for name in OPS}
    kernels = {name: getattr(ops, attribute)._backend_fns for name, attribute in OPS.items()}
    inner = {name: fns[None] for name, fns in kernels.items()}

    def capturing(name: str):
        def call(*args, **kwargs):
            calls[name].append((args, kwargs))
            return inner[name](*args, **kwargs)

        return call

    try:
        for name, fns in kernels.items():
            fns[None] = capturing(name)
        step()
    finally:
        for name, fns in kernels.items():
            fns[None] = inner[name]
    return calls


def one_rank_at_a_time(fn: Callable[[], None]) -> None:
    """Run ``fn`` on each rank in turn, the others waiting (nothing in it may wait for them)."""
    import torch.distributed as dist

    for turn in range(dist.get_world_size()):
        dist.barrier()
        if turn == dist.get_rank():
            fn()
    dist.barrier()


def replayed_costs(
    calls: dict[str, list[tuple[tuple, dict]]], repeats: int, cost: Callable
) -> dict[str, list[tuple[float, int, float]]]:
    """Per op name, each captured call's ``cost(profiler event)`` replayed: the median over
    ``repeats`` replays (its kernel count from the first). Each replay is the second of two
    under one profiler: the first calls a profiler records cost it up to twice their time
    (``profiled_events``)."""
    from torch.profiler import ProfilerActivity, profile

    runs: dict[str, list] = {name: [] for name in calls}

    def replay() -> None:
        for name, captured in calls.items():
            op = getattr(torch.ops.ringify, name.split("::")[1])
            for _ in range(repeats):
                with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(2):
                        for args, kwargs in captured:
                            op(*args, **kwargs)
                events = profiled_events(prof, name)[len(captured) :]
                runs[name].append([cost(e) for e in events])

    one_rank_at_a_time(replay)
    return {
        name: [median_cost(per_call) for per_call in zip(*replays, strict=True)]
        for name, replays in runs.items()
    }


def profiled_events(prof, name: str) -> list:
    """The events named ``name`` that ``prof`` recorded, in the order they began. Time the
    second of two passes: a profiler charges the first calls it records with its own start
    (a ring op's first replayed call read 1.3-2.4x the next ones here, by an amount that
    varied from session to session and swayed the ratios by up to 0.2)."""
    return sorted((e for e in prof.events() if e.name == name), key=lambda e: e.time_range.start)


def median_cost(costs: list[tuple[float, int, float]]) -> tuple[float, int, float]:
    """One call's (µs, kernels, data µs) over its measurements: the medians of the times (its
    kernels are fixed)."""
    return (
        statistics.median(c[0] for c in costs),
        costs[0][1],
        statistics.median(c[2] for c in costs),
    )


def replayed_wall_us(calls: dict[str, list[tuple[tuple, dict]]]) -> dict[str, float]:
    """Per op name, the mean wall µs of its captured calls replayed back to back with no
    profiler (whose per-op bookkeeping weighs on a call by its number of ATen ops)."""
    got: dict[str, float] = {}

    def replay() -> None:
        for name, captured in calls.items():
            op = getattr(torch.ops.ringify, name.split("::")[1])

            def calls_of_a_step(op=op, captured=captured):
                for args, kwargs in captured:
                    op(*args, **kwargs)

            got[name] = best_wall_us(calls_of_a_step) / len(captured)

    one_rank_at_a_time(replay)
    return got


def best_wall_us(fn: Callable[[], None], rounds: int = 5, loops: int = 50) -> float:
    """``fn``'s wall µs under no autograd: the best of ``rounds`` means over ``loops`` calls."""
    best = float("inf")
    with torch.no_grad():
        fn()
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(loops):
                fn()
            best = min(best, (time.perf_counter() - start) / loops)
    return best * 1e6
