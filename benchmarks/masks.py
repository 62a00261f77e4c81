"""Masks as programs: per-rank memory, time and bytes of HF models with causal, padded, packed
and sliding-window masks as S grows, at ring size 2.

    python benchmarks/masks.py --seqs 8192 16384 32768 65536 131072

Models: HF Llama and Mistral (sliding window ``--window``), 1 layer, hidden 128, 4 heads
(2 k/v heads), float32, batch 1, built from a config with random weights
(``ringify/testing/hf_models.py``). Cases: ``causal`` (no attention_mask), ``padded``
(an attention_mask whose first 5% are padding), ``packed`` (position_ids restarting for 4
documents of 10, 20, 30 and 40% of S), ``swa`` (Mistral, causal, window w).

Per rank of a ring of 2 (gloo, one torch thread each; the slowest rank's numbers):
- trace peak: the first call (export, the pass, forward and backward): peak resident set
  minus the resident set just before;
- step peak: the same for the next call; step time; bytes sent round the ring in it.
The reference is the unmodified model with no mask (one process, is_causal), measured at
the two smallest S and extrapolated linearly; "step / (ref / P)" is the target ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tabulate import tabulate

from ringify.testing import RankPool, measured_step


def _inputs(case: str, seq: int):
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (1, seq), generator=g)
    kwargs = {"input_ids": ids, "labels": ids}
    if case == "padded":
        mask = torch.ones(1, seq, dtype=torch.long)
        mask[:, : seq // 20] = 0
        kwargs["attention_mask"] = mask
    if case == "packed":
        cuts = [seq * f // 10 for f in (1, 2, 3)]
        lengths = [cuts[0], cuts[1], cuts[2], seq - sum(cuts)]
        kwargs["position_ids"] = torch.cat([torch.arange(n) for n in lengths]).view(1, seq)
    return kwargs


def _model(case: str, window: int):
    from ringify.testing import hf_models

    shape = {"layers": 1, "dim": 128, "heads": 4, "kv_heads": 2}
    if case == "swa":
        return hf_models.mistral(window, **shape)
    return hf_models.llama(max_len=1 << 20, **shape)


def step(case: str, seq: int, window: int, ringified: bool) -> dict:
    import torch
    import torch.distributed as dist

    from ringify import ringify
    from ringify.runtime.collectives.ring import SentBytes

    torch.manual_seed(0)
    model = _model(case, window)
    run = ringify(model, ring_size=dist.get_world_size()) if ringified else model
    kwargs = _inputs(case, seq) if ringified else _inputs("causal", seq)

    def once() -> tuple[float, int, int]:
        model.zero_grad(set_to_none=True)
        with SentBytes() as sent:
            seconds, peak, _ = measured_step(lambda: run(**kwargs).loss.backward(), ringified)
        return seconds, peak, sent.bytes

    _, trace_peak, _ = once()
    seconds, peak, sent = once()
    return {"s": seconds, "peak": peak, "trace": trace_peak, "sent": sent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--cases", nargs="+", default=["swa", "causal", "padded", "packed"])
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--out", default="", help="a file to append each row to as it comes")
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks

    one, two = RankPool(1), RankPool(2)
    rows = []
    try:
        ref = {
            s: one.run(step, "causal", s, args.window, False, timeout=3600)[0]
            for s in args.seqs[:2]
        }
        (s0, r0), (s1, r1) = sorted(ref.items())
        slope = (r1["peak"] - r0["peak"]) / (s1 - s0)
        for case in args.cases:
            for seq in args.seqs:
                per_rank = two.run(step, case, seq, args.window, True, timeout=3600)
                r = {k: max(x[k] for x in per_rank) for k in ("s", "peak", "trace", "sent")}
                reference = r0["peak"] + slope * (seq - s0)
                row = {
                    "case": case,
                    "S": seq,
                    "step s": round(r["s"], 2),
                    "trace peak MiB": round(r["trace"] / 2**20, 1),
                    "step peak MiB": round(r["peak"] / 2**20, 1),
                    "trace / step": round(r["trace"] / r["peak"], 2),
                    "step / (ref / 2)": round(r["peak"] * 2 / reference, 3),
                    "sent MiB": round(r["sent"] / 2**20, 1),
                }
                rows.append(row)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
                print(row, flush=True)
    finally:
        one.close()
        two.close()
    print(f"Command: python {' '.join(sys.argv)}")
    print(f"reference (unmodified, no mask, one process): {ref}")
    print(tabulate(rows, headers="keys", tablefmt="github"))


if __name__ == "__main__":
    main()
