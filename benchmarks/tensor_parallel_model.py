"""TP inside a node beside the ring across nodes: a paper model, not a measurement.

    python -m benchmarks.tensor_parallel_model

One Llama-3-70B layer (hidden 8192, 64 heads, 8 K/V heads, head dim 128, MLP 28672, bf16,
causal, batch 1), one training step (forward + backward) per GPU, on nodes of 8 H100 with TP8
inside each node (NVLink 450 GB/s) and the ring of CP across nodes (50 GB/s per GPU), every
kernel at 400 TFLOP/s. Per GPU: S / CP tokens, 64 / 8 heads on one K/V head.

- the projections and MLP: 6 FLOPs per parameter and token, over TP;
- the attention on the ring: ``ringify.runtime.collectives.transport_costs.seconds`` (each step's K/V and
  dK/dV hidden behind its kernels where shorter, a CP rank per node);
- TP's collectives as ringify writes them: per layer, two all-reduces forward (after o_proj
  and down_proj) and two backward (the attention's and the MLP's input), each of the
  (S / CP) x hidden activations, a ring all-reduce sending 2 (TP - 1) / TP of them, not
  hidden behind compute (ringify's TP collectives are not overlapped).

eff = the layer's compute time / its modelled time; TFLOP/s = 400 x eff.
"""

from __future__ import annotations

import argparse
import sys

from tabulate import tabulate

from benchmarks.strategies import shape
from ringify.runtime.collectives.heads import Transport
from ringify.runtime.collectives.transport_costs import H100, seconds, sent_bytes

HIDDEN, HEADS, KV_HEADS = 8192, 64, 8
PARAMS = HIDDEN * (2 * HIDDEN + 2 * 1024) + 3 * HIDDEN * 28672  # one layer's
ELEMENT = 2  # bf16


def tp_bytes(tokens: int, tp: int) -> float:
    """Bytes one GPU sends for TP's four all-reduces of one layer's step."""
    return 4 * 2 * (tp - 1) / tp * tokens * HIDDEN * ELEMENT


def row(seq: int, tp: int, cp: int) -> dict:
    tokens = seq // cp
    attn = shape(HEADS // tp, KV_HEADS // tp, seq, cp)
    linear = 6 * PARAMS * tokens / tp / H100.flops
    kernels = seconds(attn, Transport(1), 1)  # the attention's kernels alone
    ring = seconds(attn, Transport(cp), 1)  # one CP rank per node
    tp_time = tp_bytes(tokens, tp) / H100.host_bandwidth
    compute = linear + kernels
    modelled = linear + ring + tp_time
    return {
        "S": seq,
        "TP x CP": f"{tp} x {cp}",
        "GPUs": tp * cp,
        "compute ms": f"{compute * 1e3:.1f}",
        "ring exposed ms": f"{(ring - kernels) * 1e3:.2f}",
        "TP ms": f"{tp_time * 1e3:.2f}",
        "TP MB / layer": f"{tp_bytes(tokens, tp) / 1e6:.0f}",
        "CP MB / layer": f"{sent_bytes(attn, cp)[0] / 1e6:.0f}",
        "eff": f"{compute / modelled:.3f}",
        "TFLOP/s / GPU": f"{H100.flops * compute / modelled / 1e12:.0f}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[131072, 1048576])
    parser.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--tp", type=int, default=8)
    args = parser.parse_args()
    print(f"Command: python {' '.join(sys.argv)}")
    table = [row(seq, args.tp, cp) for seq in args.seqs for cp in args.cps]
    print(tabulate(table, headers="keys", tablefmt="github", disable_numparse=True))


if __name__ == "__main__":
    main()
