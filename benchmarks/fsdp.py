"""Per-layer FSDP2 with ringify: a rank's parameter memory, what autograd saves and the step's
peak memory, on a (dp, cp) = (2, 2) mesh of 4 gloo ranks, against the unmodified model.

    python benchmarks/fsdp.py --seqs 8192 16384

HF Llama (4 layers, hidden 256, 4 heads, 2 KV heads, float32, batch 1 per dp replica),
one step = forward + backward of its loss from full token ids, after a warm-up step.
Rows, in one run: the unmodified model on one process, with and without
``gradient_checkpointing_enable()`` (non-reentrant); ringify over cp with FSDP2 per
layer and on the ringified module, with and without checkpointing, sharded over dp x cp
(gradients reduced once) and over dp; one FSDP2 unit around the ringified module.
"params": the parameter storage a rank holds between steps; "saved": the storage
autograd keeps for the backward, parameters (sharded or all-gathered) left out; "peak":
a rank's peak resident set during the step above its resident set before it.
"""

from __future__ import annotations

import argparse
import os
import sys

from tabulate import tabulate

from ringify.testing import RankPool, measured_step, saved_for_backward_bytes

CONFIGS = {  # name -> (checkpointed, FSDP units, FSDP mesh)
    "unmodified": (False, None, None),
    "unmodified, checkpointed": (True, None, None),
    "per layer over dp x cp": (False, "per layer", "dp x cp"),
    "per layer over dp x cp, checkpointed": (True, "per layer", "dp x cp"),
    "per layer over dp, checkpointed": (True, "per layer", "dp"),
    "one unit over dp x cp, checkpointed": (True, "one unit", "dp x cp"),
}


def step(config: str, seq: int) -> dict:
    """On every rank: a warm-up step, then one measured step."""
    import torch
    import torch.distributed as dist

    from ringify import ringify
    from ringify.testing.hf_models import llama

    checkpointed, units, over = CONFIGS[config]
    torch.manual_seed(0)
    model = llama(layers=4, dim=256, heads=4, kv_heads=2, vocab=512, max_len=seq)
    if checkpointed:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    run = model
    if units is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        shard_over = mesh["dp", "cp"]._flatten() if over == "dp x cp" else mesh["dp"]
        if units == "per layer":
            for layer in model.model.layers:
                fully_shard(layer, mesh=shard_over)
        run = fully_shard(ringify(model, ring_size=2, mesh=mesh["cp"]), mesh=shard_over)
    params = sum(_local(p).untyped_storage().nbytes() for p in model.parameters())
    ids = torch.randint(0, 512, (1, seq), generator=torch.Generator().manual_seed(1))

    def once():
        model.zero_grad(set_to_none=True)

        def step():
            saved, out = saved_for_backward_bytes(
                lambda: run(input_ids=ids, labels=ids), leave_out=model.parameters
            )
            out.loss.backward()
            return saved, out.loss.item()

        return measured_step(step, barrier=dist.is_initialized())

    once()
    seconds, peak, (saved, loss) = once()
    return {"s": seconds, "params": params, "peak": peak, "saved": saved, "loss": loss}


def _local(p):
    return p.to_local() if hasattr(p, "to_local") else p


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384])
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks
    one, four = RankPool(1), RankPool(4)
    rows = []
    try:
        for seq in args.seqs:
            results = {}
            for config, (_, units, _) in CONFIGS.items():
                pool = one if units is None else four
                per_rank = pool.run(step, config, seq, timeout=3600)
                results[config] = {
                    k: max(r[k] for r in per_rank) for k in ("s", "params", "peak", "saved")
                } | {"loss": per_rank[0]["loss"]}
            base = results["unmodified"]
            for config, r in results.items():
                rows.append(
                    {
                        "S": seq,
                        "run": config,
                        "step s": round(r["s"], 2),
                        "params MiB / rank": round(r["params"] / 2**20, 2),
                        "params / unmodified": round(r["params"] / base["params"], 3),
                        "saved MiB / rank": round(r["saved"] / 2**20, 1),
                        "saved / unmodified": round(r["saved"] / base["saved"], 3),
                        "peak MiB / rank": round(r["peak"] / 2**20, 1),
                        "peak / unmodified": round(r["peak"] / base["peak"], 3),
                        "loss": f"{r['loss']:.6f}",
                    }
                )
                print(tabulate([rows[-1]], headers="keys", tablefmt="github"), flush=True)
    finally:
        one.close()
        four.close()
    print()
    print(f"Command: python {' '.join(sys.argv)}")
    print(tabulate(rows, headers="keys", tablefmt="github"))


if __name__ == "__main__":
    main()
