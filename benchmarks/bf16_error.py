"""bfloat16 error of ring_attention against a float64 truth, as the ring grows.

    python benchmarks/bf16_error.py

Prints, for ring sizes 1, 2, 4 and 8 (gloo ranks on CPU), the relative error
||x - truth|| / ||truth|| of out, dq, dk and dv divided by single-process
bfloat16 SDPA's own relative error on the same inputs (causal, zigzag, GQA).
A ratio that grows with the ring size is merge drift.
"""

from __future__ import annotations

import sys

import torch
from tabulate import tabulate

from ringify.runtime.collectives.layout import unshard
from ringify.testing import RankPool
from ringify.testing.ring_vs_sdpa import (
    make_inputs,
    reference,
    ring_forward_backward,
)
from ringify.testing.tolerance import relative_difference


def main() -> None:
    inputs = make_inputs(2, 8, 2, 512, 64, torch.bfloat16)
    kwargs = {"is_causal": True, "enable_gqa": True}
    truth = reference(*(t.double() for t in inputs), kwargs)
    sdpa = reference(*inputs, kwargs)
    rows = [
        {
            "ring size": "sdpa (bf16)",
            **{
                n: relative_difference(s, t)
                for n, s, t in zip(("out", "dq", "dk", "dv"), sdpa, truth, strict=True)
            },
        }
    ]
    for world in (1, 2, 4, 8):
        if world == 1:
            per_rank = [ring_forward_backward(*inputs, "zigzag", kwargs)]
        else:
            pool = RankPool(world)
            try:
                per_rank = pool.run(ring_forward_backward, *inputs, "zigzag", kwargs, timeout=600)
            finally:
                pool.close()
        got = [unshard([r[i] for r in per_rank], 2, "zigzag") for i in range(4)]
        row = {"ring size": world}
        for name, g, s, t in zip(("out", "dq", "dk", "dv"), got, sdpa, truth, strict=True):
            row[name] = (
                f"{relative_difference(g, t):.3g} ({relative_difference(g, t) / relative_difference(s, t):.2f}x)"
            )
        rows.append(row)
    rows[0] = {k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in rows[0].items()}
    print(f"Command: python {' '.join(sys.argv)}")
    print(
        "Relative error vs float64 truth (ratio to single-process bf16 SDPA's), B=2 H=8 KV=2 S=512 D=64:"
    )
    print(tabulate(rows, headers="keys", tablefmt="github"))


if __name__ == "__main__":
    main()
