"""Activation checkpointing on the ring: what autograd saves and the step's peak memory per
rank, with and without HF's gradient checkpointing, ringified and unmodified, on CPU.

    python benchmarks/checkpointing.py --seqs 8192 16384

HF Llama (4 layers, hidden 256, 4 heads, 2 KV heads, float32, batch 1), one step =
forward + backward of its loss from full token ids. Rows, in one run, round-robin:
the unmodified model on one process and ``ringify`` on 2 gloo ranks, each without and
with ``gradient_checkpointing_enable()`` (non-reentrant). "saved" is the storage
autograd keeps for the backward, parameters left out (saved_tensors_hooks); "peak" a
rank's peak resident set during the step above its resident set before it.
"""

from __future__ import annotations

import argparse
import os
import sys

from tabulate import tabulate

from ringify.testing import RankPool, measured_step, saved_for_backward_bytes


def step(impl: str, checkpointed: bool, seq: int) -> dict:
    """On every rank: a warm-up step, then one measured step."""
    import torch
    import torch.distributed as dist

    from ringify import ringify
    from ringify.testing.hf_models import llama

    torch.manual_seed(0)
    model = llama(layers=4, dim=256, heads=4, kv_heads=2, vocab=512, max_len=seq)
    if checkpointed:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    run = model if impl == "unmodified" else ringify(model, ring_size=dist.get_world_size())
    ids = torch.randint(0, 512, (1, seq), generator=torch.Generator().manual_seed(1))
    params = list(model.parameters())

    def once():
        model.zero_grad(set_to_none=True)

        def step():
            saved, out = saved_for_backward_bytes(
                lambda: run(input_ids=ids, labels=ids), leave_out=params
            )
            out.loss.backward()
            return saved, out.loss.item()

        return measured_step(step)

    once()
    seconds, peak, (saved, loss) = once()
    return {"s": seconds, "peak": peak, "saved": saved, "loss": loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384])
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks
    one, two = RankPool(1), RankPool(2)
    rows = []
    try:
        for seq in args.seqs:
            results = {}
            for impl, pool in (("unmodified", one), ("ringify P=2", two)):
                for checkpointed in (False, True):
                    per_rank = pool.run(step, impl, checkpointed, seq, timeout=3600)
                    results[impl, checkpointed] = {
                        k: max(r[k] for r in per_rank) for k in ("s", "peak", "saved")
                    } | {"loss": per_rank[0]["loss"]}
            for (impl, checkpointed), r in results.items():
                plain = results[impl, False]
                rows.append(
                    {
                        "S": seq,
                        "model": impl,
                        "checkpointed": checkpointed,
                        "step s": round(r["s"], 2),
                        "saved MiB / rank": round(r["saved"] / 2**20, 1),
                        "saved / not checkpointed": round(r["saved"] / plain["saved"], 3),
                        "peak MiB / rank": round(r["peak"] / 2**20, 1),
                        "peak / not checkpointed": round(r["peak"] / plain["peak"], 3),
                        "loss": f"{r['loss']:.6f}",
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
