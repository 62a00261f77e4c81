"""Which transport to pick on a GPU cluster: a paper model, not a measurement.

    python -m benchmarks.strategies

One Llama-3 layer (8B: hidden 4096, 32 heads, 8 K/V heads; 70B: hidden 8192, 64 heads, 8 K/V
heads; head dim 128, bf16, causal, batch 1), one training step (forward + backward) per GPU,
on nodes of 8 H100 (NVLink 450 GB/s inside a node, 50 GB/s per GPU between nodes, 400
TFLOP/s achieved by every kernel). The attention's time per transport is
``ringify.runtime.collectives.transport_costs.seconds`` (the ring's steps hidden behind their kernels
where shorter, an all-to-all not hidden); the layer's projections and MLP (6 FLOPs per
parameter and token) are the same for every transport and hide nothing. eff = the layer's
compute time / its modelled time. "auto" is what ``strategy="auto"`` picks for the same
shape (``transport_costs.fastest``).
"""

from __future__ import annotations

import argparse
import sys

from tabulate import tabulate

from ringify.runtime.collectives.heads import Transport
from ringify.runtime.collectives.transport_costs import H100, Shape, fastest, seconds, transports

HEAD_DIM, PER_HOST = 128, 8
# heads, K/V heads, parameters of one layer (q, k, v, o and the MLP)
MODELS = {
    "Llama-3-8B": (32, 8, 4096 * (2 * 4096 + 2 * 1024) + 3 * 4096 * 14336),
    "Llama-3-70B": (64, 8, 8192 * (2 * 8192 + 2 * 1024) + 3 * 8192 * 28672),
}


def shape(heads: int, kv_heads: int, seq: int, gpus: int) -> Shape:
    rows = seq // gpus
    return Shape(
        q=heads * rows * HEAD_DIM, kv=2 * kv_heads * rows * HEAD_DIM, rows=heads * rows,
        heads=heads, kv_heads=kv_heads, keys=seq,
    )  # fmt: skip


def name(transport: Transport) -> str:
    u = transport.heads_group
    return "ring" if u == 1 else "ulysses" if transport.groups == 1 else f"hybrid u={u}"


def rows(seqs: list[int], gpu_counts: list[int]) -> list[dict]:
    out = []
    for model, (heads, kv_heads, params) in MODELS.items():
        for seq in seqs:
            for gpus in gpu_counts:
                s = shape(heads, kv_heads, seq, gpus)
                linear = 6 * params * (seq // gpus) / H100.flops
                attention = seconds(s, Transport(1), 1)  # its kernels alone, nothing sent
                compute = linear + attention
                modelled = {
                    name(t): seconds(s, t, PER_HOST) + linear
                    for t in transports(heads, kv_heads, gpus)
                }
                row = {"model": model, "S": seq, "GPUs": gpus, "compute ms": f"{compute * 1e3:.1f}"}
                for strategy in ("ring", "ulysses", "hybrid u=2", "hybrid u=4", "hybrid u=8"):
                    t = modelled.get(strategy)
                    row[f"{strategy} eff"] = "-" if t is None else f"{compute / t:.3f}"
                row["auto"] = name(fastest(s, gpus, PER_HOST))
                out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[32768, 131072, 1048576])
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 64])
    args = parser.parse_args()
    print(f"Command: python {' '.join(sys.argv)}")
    table = rows(args.seqs, args.gpus)
    print(tabulate(table, headers="keys", tablefmt="github", disable_numparse=True))


if __name__ == "__main__":
    main()
