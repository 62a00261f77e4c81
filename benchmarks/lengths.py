"""Training on random lengths: total time, traces and recompiles, unmodified vs ringify.

    python benchmarks/lengths.py --steps 100 --low 256 --high 8192

HF Llama (2 layers, hidden 128, 4 heads on 2 kv heads, float32, batch 1), AdamW, each
step a length drawn uniformly from [low, high) (the same draws for every run). ``unmodified``
runs in one process; ``ringify`` on 2 gloo ranks (times are the slowest rank's). Eager, and
``torch.compile`` with Inductor (``fullgraph=True`` for ringify, as the README shows). Traces
are ringify's (``ringified.traces``); Dynamo graphs are what Dynamo handed the backend
(recompiles + 1). The first step's time (trace, compile) is reported apart from the rest.
"""

from __future__ import annotations

import argparse
import sys
import time

from tabulate import tabulate

from ringify.testing.ranks import RankPool


def run(impl: str, backend: str | None, steps: int, low: int, high: int) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from ringify import ringify

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1 << 16,
        use_cache=False,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    ringified = ringify(model, ring_size=dist.get_world_size()) if impl == "ringify" else None
    fn = ringified or model
    graphs = []
    if backend:

        def counted(gm, example_inputs):
            graphs.append(gm)
            return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

        torch._dynamo.reset()
        fn = torch.compile(fn, backend=counted, fullgraph=impl == "ringify")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(7)
    lengths = [int(torch.randint(low, high, (1,), generator=g)) for _ in range(steps)]
    times = []
    for length in lengths:
        ids = torch.randint(0, 1024, (1, length), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        loss = fn(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return {
        "s": sum(times),
        "first": times[0],
        "distinct": len(set(lengths)),
        "traces": ringified.traces if ringified else 0,
        "graphs": len(graphs),
        "lengths": ringified.report().lengths if ringified else "",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--low", type=int, default=256)
    parser.add_argument("--high", type=int, default=8192)
    args = parser.parse_args()
    rows = []
    pools = {1: RankPool(1), 2: RankPool(2)}
    try:
        for backend in (None, "inductor"):
            for impl, p in (("unmodified", 1), ("ringify", 2)):
                ranks = pools[p].run(
                    run, impl, backend, args.steps, args.low, args.high, timeout=7200
                )
                r = ranks[0] | {k: max(x[k] for x in ranks) for k in ("s", "first")}
                rows.append({
                    "run": impl if impl == "unmodified" else f"ringify P={p}",
                    "mode": backend or "eager",
                    "steps": args.steps,
                    "distinct lengths": r["distinct"],
                    "total s": round(r["s"], 1),
                    "first step s": round(r["first"], 1),
                    "rest s / step": round((r["s"] - r["first"]) / (args.steps - 1), 3),
                    "ringify traces": r["traces"] if impl == "ringify" else "-",
                    "Dynamo graphs": r["graphs"] if backend else "-",
                    "report": r["lengths"],
                })  # fmt: skip
    finally:
        for pool in pools.values():
            pool.close()
    print(f"Command: python {' '.join(sys.argv)}")
    print(tabulate(rows, headers="keys", tablefmt="github"))


if __name__ == "__main__":
    main()
