"""Copy kernels in one backward step of a ringified HF model, inside the ring ops and out.

A model's q, k and v are views of its projections; where the ring op's gradients come back
laid out as those views, the model's own backward needs no copy to take them (and where the
op takes its incoming gradient as it is laid out, neither does the op). This counts the leaf
``aten::copy_`` events of one ``loss.backward()`` under ``torch.profiler`` on rank 0 of 2,
split into those under a ``ringify::`` op and the rest: GPT-2 (q, k and v split from one
projection) and Llama (RoPE, GQA), 4 layers of hidden 128, float32.

    python -m benchmarks.step_copies --seq 2048

An earlier tree is measured by putting it first on ``PYTHONPATH`` and running this file.
"""

from __future__ import annotations

import argparse

import torch
from tabulate import tabulate

from ringify.testing import RankPool


def copies(kind: str, seq: int) -> tuple[int, int]:
    """On every rank: (copies under a ring op, copies elsewhere) in one backward step."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from ringify import ringify
    from ringify.testing import hf_models

    torch.manual_seed(0)
    if kind == "gpt2":
        model = hf_models.gpt2(layers=4, dim=128, heads=4, max_len=seq)
    else:
        model = hf_models.llama(layers=4, dim=128, heads=4, kv_heads=2, max_len=seq)
    ids = torch.randint(1, 64, (1, seq))
    ringified = ringify(model, ring_size=dist.get_world_size())
    ringified(input_ids=ids, labels=ids).loss.backward()  # trace, plan
    model.zero_grad(set_to_none=True)
    loss = ringified(input_ids=ids, labels=ids).loss
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss.backward()
    counts = [0, 0]
    stack = [(e, False) for e in prof.events() if e.cpu_parent is None]
    while stack:
        event, under_op = stack.pop()
        under_op = under_op or event.name.startswith("ringify::")
        leaf = not any(c.name.startswith("aten::") for c in event.cpu_children)
        if event.name == "aten::copy_" and leaf:
            counts[0 if under_op else 1] += 1
        stack.extend((c, under_op) for c in event.cpu_children)
    return counts[0], counts[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()
    pool = RankPool(2)
    rows = []
    try:
        for kind in ("gpt2", "llama"):
            inside, outside = pool.run(copies, kind, args.seq, timeout=3600)[0]
            rows.append([kind, args.seq, inside, outside, inside + outside])
    finally:
        pool.close()
    headers = ["model", "S", "copies in ring ops", "copies elsewhere", "total"]
    print(tabulate(rows, headers=headers, tablefmt="github"))


if __name__ == "__main__":
    main()
