"""Per-rank peak memory and step time of a FlexAttention document-mask model, ringified.

    python benchmarks/flex_documents.py --seqs 4096 8192

The tests' ``FlexTransformer`` (ringify/testing/models.py): a torchtitan-style decoder,
2 layers, hidden 256, 8 heads on 4 kv heads, whose attention is ``flex_attention`` with a
``BlockMask`` built in ``forward`` from a causal-within-documents ``mask_mod`` (documents
of 1-2K tokens, packed), and its SDPA spelling (``attend="sdpa"``: the same ``mask_mod`` as
a dense (B, 1, S, S) bool mask). float32, batch 1. FlexAttention has no backward on the
CPU, and in eager mode (no ``torch.compile``) it computes the dense scores; so two kinds
of step: ``forward`` (no gradients: the unmodified flex model, its SDPA spelling, ringify
of the flex model on 2 gloo ranks) and ``train`` (forward + backward of the mean logit: the
SDPA spelling against ringify of the flex model, traced once without gradients). Rows in
one run, round-robin, minimum over repeats; a ring's time is its slowest rank's.

Memory: a rank's peak resident set during the step minus its resident set just before
(model and inputs built): activations, gradients, buffers.
"""

from __future__ import annotations

import argparse
import os
import sys

from tabulate import tabulate

from ringify.testing import measured_step
from ringify.testing.rounds import best_of_rounds


def step(impl: str, kind: str, seq: int) -> dict:
    """On every rank: one warm-up step, then one timed and measured."""
    import torch
    import torch.distributed as dist

    from ringify import ringify
    from ringify.testing.models import FlexTransformer

    torch.manual_seed(0)
    attend = "sdpa" if impl == "sdpa spelling" else "flex"
    model = FlexTransformer(vocab=1024, dim=256, heads=8, kv_heads=4, attend=attend)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1024, (1, seq), generator=g)
    docs = torch.cumsum(torch.rand(1, seq, generator=g) < 1 / 1536, 1)
    run = model
    if impl == "ringify":
        run = ringify(model, ring_size=dist.get_world_size())
        with torch.no_grad():
            model.requires_grad_(False)
            run(ids, docs)  # traced without gradients (CPU flex has no backward)
            model.requires_grad_(True)

    def once() -> tuple[float, int, float]:
        model.zero_grad(set_to_none=True)

        def step() -> float:
            if kind == "forward":
                with torch.no_grad():
                    return run(ids, docs).mean().item()
            loss = run(ids, docs).mean()
            loss.backward()
            return loss.item()

        return measured_step(step)

    once()  # warm-up: trace, allocator, communicators
    seconds, peak, loss = once()
    return {"s": seconds, "peak": peak, "loss": loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks

    runs = {
        "forward": (("unmodified", 1), ("sdpa spelling", 1), ("ringify", 2)),
        "train": (("sdpa spelling", 1), ("ringify", 2)),
    }
    configs = [(kind, impl, p, seq) for seq in args.seqs for kind in runs for impl, p in runs[kind]]
    best = best_of_rounds(
        step, [(p, (impl, kind, seq)) for kind, impl, p, seq in configs], args.repeats
    )
    rows = []
    for i, (kind, impl, p, seq) in enumerate(configs):
        base = best[next(j for j, c in enumerate(configs) if c[0] == kind and c[3] == seq)]
        r = best[i]
        rows.append({
            "S": seq,
            "step": kind,
            "run": impl if p == 1 else f"ringify P={p}",
            "step s": round(r["s"], 2),
            "time / first row": round(r["s"] / base["s"], 3),
            "peak MiB / rank": round(r["peak"] / 2**20, 1),
            "memory / first row": round(r["peak"] / base["peak"], 3),
            "|loss - first row|": f"{abs(r['loss'] - base['loss']):.1e}",
        })  # fmt: skip
    print(f"Command: python {' '.join(sys.argv)}")
    print(tabulate(rows, headers="keys", tablefmt="github"))


if __name__ == "__main__":
    main()
