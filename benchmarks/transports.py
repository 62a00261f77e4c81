"""Bytes one rank sends per attention layer, forward and backward, for each transport: counted.

The ring op runs on P gloo ranks for each ``Transport`` (K/V round the ring; DeepSpeed-Ulysses;
USP's hybrid, the all-to-all inside groups of u ranks and K/V round the groups) and ``SentBytes`` counts every byte a rank sends
(P2P and its share of each all-to-all). Causal, zigzag, K/V heads repeated only as far as an
all-to-all needs. Counted in bf16 (the ring's dK/dV travel in its float32 accumulators, an
lse in float32) at a small shape, and scaled exactly (bytes are linear in the rows and the
head dim) to 1024 tokens per rank and head dim 128. Nothing is timed.

    python -m benchmarks.transports --rings 2 4 8
"""

from __future__ import annotations

import argparse

from tabulate import tabulate

SHAPES = {"Llama-3-8B (32 heads, 8 K/V)": (32, 8), "head-poor (8 heads, 1 K/V)": (8, 1)}
ROWS, DIM = 32, 16  # counted at; scaled to 1024 rows and head dim 128


def counted(heads: int, kv_heads: int, heads_group: int) -> tuple[int, int]:
    """On every rank: the bytes it sends in one forward and in one backward, the all-to-all
    over groups of ``heads_group`` ranks (1: none, the ring)."""
    import torch
    import torch.distributed as dist

    from ringify.runtime.attention.spec import AttentionSpec
    from ringify.runtime.collectives.heads import Transport
    from ringify.runtime.collectives.ring import SentBytes

    name, world = dist.group.WORLD.group_name, dist.get_world_size()
    q, dout = (torch.randn(1, heads, ROWS, DIM, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, kv_heads, ROWS, DIM, dtype=torch.bfloat16) for _ in range(2))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    seq = ROWS * world
    plan = torch.ops.ringify.attention_plan("", [], ROWS, True, name, "zigzag", seq, 0, False,
                                            Transport(world, heads_group))  # fmt: skip
    args = (None, [], seq, AttentionSpec(name, DIM**-0.5, True, "zigzag", balance=False), plan)
    with SentBytes() as forward:
        out, _ = torch.ops.ringify.ring_attention(q, k, v, *args)
    with SentBytes() as backward:
        out.backward(dout)
    return forward.bytes, backward.bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rings", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    from ringify.runtime.collectives.heads import Transport
    from ringify.testing import RankPool

    scale = (1024 / ROWS) * (128 / DIM)  # (an lse is per row, not per head dim: a bound)
    rows = []
    for world in args.rings:
        groups = [1, world, *(u for u in (2, 4) if 1 < u < world and world % u == 0)]
        pool = RankPool(world)
        try:
            for label, (heads, kv_heads) in SHAPES.items():
                for u in groups:
                    per_rank = pool.run(counted, heads, kv_heads, u, timeout=600)
                    fwd, bwd = (max(r[i] for r in per_rank) for i in (0, 1))
                    rows.append({
                        "P": world, "shape": label, "transport": str(Transport(world, u)),
                        "fwd MiB/layer": round(fwd * scale / 2**20, 2),
                        "bwd MiB/layer": round(bwd * scale / 2**20, 2),
                    })  # fmt: skip
        finally:
            pool.close()
    print("Command: python -m benchmarks.transports --rings", *args.rings)
    print(tabulate(rows, headers="keys", tablefmt="github"))


if __name__ == "__main__":
    main()
