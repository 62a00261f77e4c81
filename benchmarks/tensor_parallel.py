"""Tensor parallelism beside the ring on 4 gloo ranks: per-rank peak memory, step time and the
bytes each parallelism moves, for (tp, cp) = (2, 2) against cp = 4 alone and tp = 4 alone.

    python -m benchmarks.tensor_parallel --seqs 4096 16384

The model is ``ringify.testing.titan.Transformer`` (a torchtitan-style Llama: 2 layers,
hidden 256, 8 heads on 4 K/V heads, vocab 1024), float32, batch 1, with torchtitan's TP plan
(``parallelize``: every projection, the embedding's vocabulary and the head split). One step
is forward + backward of the mean cross entropy, from the full ids on every rank.

- ``tp=2 x cp=2``: ``parallelize(model, mesh["tp"])``, then ``ringify(model, ring_size=2,
  mesh=mesh["cp"])``;
- ``cp=4``: ``ringify(model, ring_size=4)``;
- ``tp=4``: ``parallelize(model, mesh)`` alone (DTensor's own TP, every rank the whole
  sequence).

Memory: a rank's peak resident set during the step minus its resident set just before
(model and inputs built). Bytes, counted from the report, per layer and step on one rank:
TP's collectives (``report().tensor_parallel``, ring all-reduce 2 (t-1)/t of the tensor) and
the ring's K/V and dK/dV (``report().attentions[i].ring_bytes``). Rows in one run,
round-robin, the least of the repeats.
"""

from __future__ import annotations

import argparse
import os
import sys

from tabulate import tabulate

from ringify.testing import measured_step
from ringify.testing.rounds import best_of_rounds

LAYERS, DIM, HEADS, KV_HEADS, VOCAB = 2, 256, 8, 4, 1024


def step(impl: str, seq: int) -> dict:
    """On every rank: one warm-up step, then one timed and measured."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from ringify import ringify
    from ringify.testing.titan import Transformer, parallelize

    torch.manual_seed(0)
    model = Transformer(vocab=VOCAB, dim=DIM, layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS)
    run = model
    if impl == "tp=2 x cp=2":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "cp"))
        run = ringify(parallelize(model, mesh["tp"]), ring_size=2, mesh=mesh["cp"])
    elif impl == "cp=4":
        run = ringify(model, ring_size=4)
    elif impl == "tp=4":
        run = parallelize(model, init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)))
    g = torch.Generator().manual_seed(1)
    tokens, labels = (torch.randint(0, VOCAB, (1, seq), generator=g) for _ in range(2))

    def once():
        model.zero_grad(set_to_none=True)

        def one() -> float:
            loss = run(tokens, labels)
            loss.backward()
            return loss.item()

        return measured_step(one)

    once()  # warm-up: trace, allocator, communicators
    seconds, peak, loss = once()
    tp_bytes = cp_bytes = 0
    if impl != "tp=4":
        report = run.report()
        tp_bytes = sum(
            c.sent_bytes for c in report.tensor_parallel if c.layers.startswith("layers.")
        )
        cp_bytes = sum(a.ring_bytes or 0 for a in report.attentions)
    return {"s": seconds, "peak": peak, "loss": loss, "tp": tp_bytes, "cp": cp_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks

    impls = ["tp=2 x cp=2", "cp=4", "tp=4"]
    configs = [(impl, seq) for seq in args.seqs for impl in impls]
    best = best_of_rounds(step, [(4, c) for c in configs], args.repeats)
    rows = []
    for (impl, seq), r in zip(configs, best, strict=True):
        base = best[configs.index(("tp=2 x cp=2", seq))]
        rows.append({
            "S": seq,
            "run": impl,
            "step s": round(r["s"], 2),
            "time / tp2xcp2": round(r["s"] / base["s"], 3),
            "peak MiB / rank": round(r["peak"] / 2**20, 1),
            "memory / tp2xcp2": round(r["peak"] / base["peak"], 3),
            "TP MiB / layer": round(r["tp"] / LAYERS / 2**20, 2) if impl != "tp=4" else "n/a",
            "CP MiB / layer": round(r["cp"] / LAYERS / 2**20, 2) if impl != "tp=4" else "n/a",
            "loss": f"{r['loss']:.6f}",
        })  # fmt: skip
    print(f"Command: python {' '.join(sys.argv)}")
    print(tabulate(rows, headers="keys", tablefmt="github"))


if __name__ == "__main__":
    main()
