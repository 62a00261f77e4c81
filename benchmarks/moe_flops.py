"""Expert work per rank of mixture-of-experts LMs on the ring, counted from the graphs.

For HF Qwen3-MoE, Mixtral, DeepSeek-V3 and gpt-oss (``ringify/testing/hf_moe.py``: tiny configs,
experts run by HF's ``batched_mm``, or with ``--experts grouped_mm`` by HF's default, in
float32: the routed slots sorted by expert), batch 2 of ``--seq`` tokens: the FLOPs of every
expert product (``bmm``, or a grouped product: 2 x rows x inner x outer, from each node's
value) and the rows it multiplies, in the unmodified model's exported graph and in one rank's
rewritten graph, on rings of 2 and 4. Counted, not timed: the ratio per rank is what a GPU's
expert work becomes.

    python -m benchmarks.moe_flops --seq 256 [--experts grouped_mm]
"""

from __future__ import annotations

import argparse
import math

from tabulate import tabulate

from ringify.passes.graph.vocabulary import GROUPED_MM
from ringify.testing import RankPool

MODELS = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")


def expert_work(gm) -> tuple[int, int]:
    """(rows, FLOPs) of every batched or grouped expert product of ``gm`` and its submodules
    (a grouped product multiplies each row by one expert's (inner x outer) matrix)."""
    import torch

    rows = flops = 0
    for m in gm.modules():
        if not isinstance(m, torch.fx.GraphModule):
            continue
        for n in m.graph.nodes:
            if n.target is torch.ops.aten.bmm.default and n.meta["val"].dim() == 3:
                a, b = (x.meta["val"].shape for x in n.args[:2])
                rows += a[0]
                flops += 2 * a[0] * a[1] * a[2] * b[2]
            elif str(n.target) in GROUPED_MM:
                a, b = (x.meta["val"].shape for x in n.args[:2])
                rows += a[0]
                flops += 2 * a[0] * b[1] * b[2]
    return rows, flops


def count(name: str, seq: int, experts: str) -> dict:
    import torch
    import torch.distributed as dist

    from ringify import ringify
    from ringify.testing import hf_moe

    torch.manual_seed(0)
    model = getattr(hf_moe, name)()
    if experts != "batched_mm":  # grouped_mm takes no float64: the tiny models in float32
        model = model.float()
        model.set_experts_implementation(experts)
    ids = torch.randint(1, 64, (2, seq), generator=torch.Generator().manual_seed(1))
    whole = torch.export.export(model, (), {"input_ids": ids, "labels": ids}, strict=False)
    ringified = ringify(model, ring_size=dist.get_world_size())
    ringified(input_ids=ids, labels=ids).loss.backward()
    return {
        "whole": expert_work(whole.module()),
        "rank": expert_work(ringified._active.module),
        "gathers": len(ringified.report().gathers),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--experts", default="batched_mm", choices=["batched_mm", "grouped_mm"])
    args = parser.parse_args()
    rows = []
    for world in (2, 4):
        pool = RankPool(world)
        try:
            for name in MODELS:
                r = pool.run(count, name, args.seq, args.experts, timeout=900)[0]
                (whole_rows, whole_flops), (rank_rows, rank_flops) = r["whole"], r["rank"]
                rows.append([
                    name, world, whole_rows, rank_rows, f"{whole_flops / 1e6:.2f}",
                    f"{rank_flops / 1e6:.2f}", f"{rank_flops / whole_flops:.3f}",
                    f"{1 / world:.3f}", r["gathers"],
                ])  # fmt: skip
        finally:
            pool.close()
    headers = ["model", "P", "expert rows, model", "per rank", "MFLOP, model", "per rank",
               "rank / model", "ideal 1/P", "gathers"]  # fmt: skip
    print(tabulate(rows, headers=headers, tablefmt="github"))
    assert all(math.isclose(float(r[6]), float(r[7])) for r in rows)


if __name__ == "__main__":
    main()
