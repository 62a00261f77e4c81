"""Benchmark rows taken side by side: configurations run round-robin, the best of each."""

from __future__ import annotations

from ringify.testing.ranks import RankPool


def best_of_rounds(step, configs: list[tuple[int, tuple]], repeats: int) -> list[dict]:
    """For each ``(ranks, args)`` of ``configs``, ``step(*args)`` on a pool of that many ranks,
    all configurations in turn, ``repeats`` rounds. Per configuration: ``s`` and ``peak`` of
    its slowest (largest) rank, the least over the rounds; the other keys rank 0's."""
    pools = {p: RankPool(p) for p in sorted({p for p, _ in configs})}
    best: list[dict | None] = [None] * len(configs)
    try:
        for _ in range(repeats):
            for i, (p, args) in enumerate(configs):
                per_rank = pools[p].run(step, *args, timeout=3600)
                row = per_rank[0] | {k: max(r[k] for r in per_rank) for k in ("s", "peak")}
                if best[i] is not None:
                    row |= {k: min(row[k], best[i][k]) for k in ("s", "peak")}
                best[i] = row
    finally:
        for pool in pools.values():
            pool.close()
    return best
