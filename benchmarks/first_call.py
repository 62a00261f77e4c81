"""What a first call costs: the trace beside a step, and torch.export alone.

    python benchmarks/first_call.py --seq 16384 --before 1024

On 2 gloo ranks, float32, batch 1, a forward and backward: HF Mamba (2 layers) and Jamba
(4 layers: Mamba1 mixers, attention and MoE), whose export unrolls the recurrence over the
positions, traced at small lengths (``ringify.tracing.lengths.lift_from_small``); and HF Llama (4
to 80 layers, hidden 256), whose export does not grow with the length. ``before`` traces
the Mamba models at ``--before`` positions at their own length, as ringify did before the
small trace (the per-position cost, times the length, is what it took at ``--seq``). Times
are the slowest rank's, in one run; the export column is ``torch.export`` of the unmodified
model at that length in one process (left out where the call was traced small).
"""

from __future__ import annotations

import argparse
import sys
import time

from tabulate import tabulate

from ringify.testing.ranks import RankPool


def build(name: str, layers: int):
    import torch
    import transformers as tf

    torch.manual_seed(0)
    small = dict(vocab_size=1024, num_hidden_layers=layers, use_cache=False)
    if name == "mamba":
        config = tf.MambaConfig(**small, hidden_size=64, state_size=16, use_mambapy=False)
        return tf.MambaForCausalLM(config)
    if name == "jamba":
        config = tf.JambaConfig(
            **small, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
            expert_layer_period=2, expert_layer_offset=1, num_experts=2, mamba_d_state=16,
            mamba_dt_rank=8, use_mamba_kernels=False, max_position_embeddings=1 << 20,
        )  # fmt: skip
        config._attn_implementation = "sdpa"
        return tf.JambaForCausalLM(config)
    config = tf.LlamaConfig(
        **small, hidden_size=256, intermediate_size=512, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1 << 20,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    return tf.LlamaForCausalLM(config)


def first_call(name: str, layers: int, seq: int, small: bool) -> dict:
    import torch
    import torch.distributed as dist

    from ringify import ringify
    from ringify.tracing import lengths

    model = build(name, layers)
    ring = ringify(model, ring_size=dist.get_world_size())
    ids = torch.randint(0, 1024, (1, seq), generator=torch.Generator().manual_seed(0))
    times, default = [], lengths.SMALL_FIRST
    if not small:  # as before: a first call traced at its own length
        lengths.SMALL_FIRST = float("inf")
    try:
        for _ in range(2):
            dist.barrier()
            start = time.perf_counter()
            ring(input_ids=ids, labels=ids).loss.backward()
            times.append(time.perf_counter() - start)
    finally:  # the worker process runs the next row
        lengths.SMALL_FIRST = default
    traced = "small lengths" if "small lengths" in ring.report().lengths else "its length"
    return {"first": times[0], "step": times[1], "traces": ring.traces, "traced": traced}


def export_alone(name: str, layers: int, seq: int) -> float:
    import torch

    model = build(name, layers)
    ids = torch.randint(0, 1024, (1, seq))
    start = time.perf_counter()
    torch.export.export(model, (), {"input_ids": ids, "labels": ids}, strict=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--before", type=int, default=1024)
    parser.add_argument("--llama-seq", type=int, default=4096)
    args = parser.parse_args()
    runs = [
        ("mamba", 2, args.seq, True), ("mamba", 2, args.before, False),
        ("jamba", 4, args.seq, True), ("jamba", 4, args.before, False),
        *(("llama", layers, args.llama_seq, True) for layers in (4, 16, 32, 80)),
    ]  # fmt: skip
    rows = []
    pool, one = RankPool(2), RankPool(1)
    try:
        for name, layers, seq, small in runs:
            ranks = pool.run(first_call, name, layers, seq, small, timeout=7200)
            r = {k: max(x[k] for x in ranks) for k in ("first", "step", "traces")}
            # export alone at --seq (minutes for the unrolled models) only where it is traced so
            exported = "-"
            if not small or name == "llama":
                exported = round(one.run(export_alone, name, layers, seq, timeout=7200)[0], 1)
            rows.append({
                "model": f"{name} ({layers} layers)",
                "traced at": ranks[0]["traced"],
                "positions": seq,
                "first call s": round(r["first"], 1),
                "step s": round(r["step"], 2),
                "first call - step s": round(r["first"] - r["step"], 1),
                "torch.export alone s": exported,
                "ringify traces": r["traces"],
            })  # fmt: skip
    finally:
        pool.close()
        one.close()
    print(f"Command: python {' '.join(sys.argv)}")
    print(tabulate(rows, headers="keys", tablefmt="github"))


if __name__ == "__main__":
    main()
