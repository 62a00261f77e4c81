"""Per-rank peak memory and step time of a ringified GPT vs. the unmodified model, on CPU.

    python benchmarks/gpt.py --seqs 4096 8192 16384 32768

The model is the tests' nanoGPT-style GPT (ringify/testing/models.py: learned positions, tied
embeddings, causal SDPA, the loss inside forward), float32, batch 1. One step is
forward + backward of its loss from the full token ids (inputs="full"). Rows, all
in the same run, round-robin, minimum over repeats:

- unmodified: the model itself, one process;
- ringify P=1: ``ringify(model, ring_size=1)``: the pass's own overhead;
- ringify P=2: two gloo ranks, one torch thread each; time is the slowest rank's.

Memory: a rank's peak resident set during the step minus its resident set just
before (model and inputs already built): activations, gradients and buffers
(glibc's mmap threshold is pinned so freed tensors leave the resident set).
"""

from __future__ import annotations

import argparse
import os
import sys

from tabulate import tabulate

from ringify.testing import RankPool, measured_step


def step(impl: str, seq: int, dim: int, layers: int) -> dict:
    """On every rank: one warm-up step at this length, then one timed and measured."""
    import torch
    import torch.distributed as dist

    from ringify import ringify
    from ringify.testing.models import NanoGPT

    torch.manual_seed(0)
    model = NanoGPT(vocab=512, max_len=seq, dim=dim, heads=dim // 64, layers=layers)
    run = model if impl == "unmodified" else ringify(model, ring_size=dist.get_world_size())
    g = torch.Generator().manual_seed(1)
    idx, targets = (torch.randint(0, 512, (1, seq), generator=g) for _ in range(2))

    def once() -> tuple[float, int, float]:
        model.zero_grad(set_to_none=True)

        def step() -> float:
            _, loss = run(idx, targets)
            loss.backward()
            return loss.item()

        return measured_step(step)

    once()  # warm-up: trace, kernels, allocator, communicators
    seconds, peak, loss = once()
    return {"s": seconds, "peak": peak, "loss": loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks

    one, two = RankPool(1), RankPool(2)
    rows = []
    try:
        for seq in args.seqs:
            configs = [("unmodified", one), ("ringify", one), ("ringify", two)]
            best: dict[int, dict] = {}
            for _ in range(args.repeats):
                for i, (impl, pool) in enumerate(configs):
                    per_rank = pool.run(step, impl, seq, args.dim, args.layers, timeout=3600)
                    r = {k: max(p[k] for p in per_rank) for k in ("s", "peak")}
                    r["loss"] = per_rank[0]["loss"]
                    best[i] = {k: min(r[k], best.get(i, r)[k]) for k in r}
            base = best[0]
            for i, (impl, pool) in enumerate(configs):
                p = pool.world_size
                r = best[i]
                rows.append(
                    {
                        "S": seq,
                        "model": impl if impl == "unmodified" else f"ringify P={p}",
                        "step s": round(r["s"], 2),
                        "time / unmodified": round(r["s"] / base["s"], 3),
                        "efficiency": round(base["s"] / (p * r["s"]), 3),
                        "peak MiB / rank": round(r["peak"] / 2**20, 1),
                        "memory / (unmodified / P)": round(r["peak"] * p / base["peak"], 3),
                        "|loss - unmodified|": f"{abs(r['loss'] - base['loss']):.1e}",
                    }
                )
                print(tabulate([rows[-1]], headers="keys", tablefmt="github"), flush=True)
    finally:
        one.close()
        two.close()
    print()
    print(f"Command: python {' '.join(sys.argv)}")
    print(tabulate(rows, headers="keys", tablefmt="github"))


if __name__ == "__main__":
    main()
