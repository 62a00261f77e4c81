"""Dilated (LongNet) ring attention vs. dense ring attention at ring size 2, on CPU.

    python benchmarks/dilated_attention.py --seqs 4096 8192 16384 32768 65536

Pattern: segment lengths (2048, 4096, 8192, 16384) x rates (1, 2, 4, 8), causal,
float32, batch 1, H=8, D=64; two gloo ranks with one torch thread each, in one run.
Per rank: forward + backward time (the slowest rank's, minimum over repeats), peak
memory (resident set, as in ring_attention.py), and the bytes it sent round rings
(``ringify.runtime.collectives.ring.SentBytes``), next to the bytes the pattern predicts:
a segment spanning g ranks rings among them only, with 1/rate of the rows, so a
pair sends (g - 1) * 2 * B * H * (c / rate) * D * 4 bytes forward (K and V, c rows
per rank) and (2g - 1) times that backward (K/V again, plus the dK/dV
accumulators travelling g steps). The time's growth in S is fitted as S^k.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time

from tabulate import tabulate

from ringify.testing import RankPool, reset_peak_memory, resident_bytes

B, H, D = 1, 8, 64
SEGMENTS, RATES = (2048, 4096, 8192, 16384), (1, 2, 4, 8)


def predicted_bytes(seq: int, ring: int, dilated: bool) -> tuple[int, int]:
    """(forward, backward) bytes each rank sends, from the pattern and the chunks alone."""
    rows = seq // ring
    pairs = zip(SEGMENTS, RATES, strict=True) if dilated else [(seq, 1)]
    fwd = bwd = 0
    for w, rate in pairs:
        span = min(w, seq) // rows
        if span > 1:
            per_step = 2 * B * H * (rows // rate) * D * 4
            fwd += (span - 1) * per_step
            bwd += (2 * span - 1) * per_step
    return fwd, bwd


def measure(impl: str, seq: int) -> dict:
    import torch
    import torch.distributed as dist

    from ringify.runtime import Dilation, ring_attention
    from ringify.runtime.collectives.ring import SentBytes

    dilation = Dilation(SEGMENTS, RATES) if impl == "dilated" else None
    rows = seq // dist.get_world_size()

    def run(rows: int):
        gc.collect()
        base = resident_bytes("VmRSS:")
        reset_peak_memory()
        q, k, v = (torch.randn(B, H, rows, D, requires_grad=True) for _ in range(3))
        dout = torch.randn(B, H, rows, D)
        dist.barrier()
        t0 = time.perf_counter()
        with SentBytes() as forward:
            out = ring_attention(q, k, v, is_causal=True, dilation=dilation, layout="contiguous")
        t1 = time.perf_counter()
        with SentBytes() as backward:
            out.backward(dout)
        t2 = time.perf_counter()
        memory = resident_bytes("VmHWM:") - base
        return t1 - t0, t2 - t1, memory, forward.bytes, backward.bytes

    run(rows)  # warm-up at the same length: kernels, allocator, communicators, sub-rings
    keys = ("fwd", "bwd", "mem", "sent_fwd", "sent_bwd")
    return dict(zip(keys, run(rows), strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks
    pool = RankPool(2)
    rows, times = [], {}
    try:
        for seq in args.seqs:
            for impl in ("dense", "dilated"):
                best = None
                for _ in range(args.repeats if seq < 32768 else 1):
                    per_rank = pool.run(measure, impl, seq, timeout=3600)
                    r = {key: max(p[key] for p in per_rank) for key in per_rank[0]}
                    best = r if best is None else {k: min(r[k], best[k]) for k in r}
                fwd, bwd = predicted_bytes(seq, 2, impl == "dilated")
                times[impl, seq] = best["fwd"] + best["bwd"]
                rows.append(
                    {
                        "S": seq,
                        "attention": impl,
                        "fwd s": round(best["fwd"], 3),
                        "bwd s": round(best["bwd"], 3),
                        "time / dense": round(times[impl, seq] / times["dense", seq], 3),
                        "peak MiB / rank": round(best["mem"] / 2**20, 1),
                        "sent MiB fwd / bwd": f"{best['sent_fwd'] / 2**20:.1f} / {best['sent_bwd'] / 2**20:.1f}",
                        "predicted MiB fwd / bwd": f"{fwd / 2**20:.1f} / {bwd / 2**20:.1f}",
                        "bytes match": best["sent_fwd"] == fwd and best["sent_bwd"] == bwd,
                    }
                )
                print(tabulate([rows[-1]], headers="keys", tablefmt="github"), flush=True)
    finally:
        pool.close()
    fits = []
    for impl in ("dense", "dilated"):
        xs = [math.log(s) for s in args.seqs]
        ys = [math.log(times[impl, s]) for s in args.seqs]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
            (x - mx) ** 2 for x in xs
        )
        fits.append({"attention": impl, "time ~ S^k, fitted k": round(slope, 2)})
    print()
    print(f"Command: python {' '.join(sys.argv)}")
    print(tabulate(rows, headers="keys", tablefmt="github"))
    print()
    print(tabulate(fits, headers="keys", tablefmt="github"))


if __name__ == "__main__":
    main()
