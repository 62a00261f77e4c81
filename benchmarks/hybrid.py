"""Per-rank peak memory and step time of a hybrid (attention + Mamba2) model, ringified.

    python benchmarks/hybrid.py --seqs 4096 16384 --rings 2 4

``--kinds qwen3.5``: HF Qwen3.5's text model instead (Gated DeltaNet in layers 0-2, its
chunked delta rule on a share of 8 value heads; attention in layer 3), the same sizes.
``--kinds jamba``: HF Jamba (Mamba1 mixers in layers 0 and 2, their selective scans passing
state round the ring; attention in 1 and 3; dense MLPs). Its unmodified torch path loops over
the positions, and its backward grows faster than S (each position's ``select`` back-propagates
a full-size gradient): ``--rings 1 2 --no-unmodified`` takes the ringified graph on one
process as the baseline at lengths the unmodified model cannot reach here.

HF Bamba (``BambaForCausalLM``, its torch path: no CUDA kernels here), 4 layers, hidden
256: ``hybrid`` has attention in layers 1 and 3 and Mamba2 mixers in layers 0 and 2;
``attention only`` is the same model with attention in every layer (the SDPA spelling of
every mixer), as a reference for what sharding does when nothing is gathered. ringify
shards the attention, the MLPs, the norms and the Mamba's causal convolution (a halo
exchange); the SSM's chunked scan has no sequence rule: it runs on every position of a
share of its heads, its inputs moved there by one all-to-all each
(``report().resharded``; before that, they were gathered, ``report().gathers``). float32, batch 1; one
step is forward + backward of the mean logit, from the full ids on every rank. Rows in
one run, round-robin, minimum over repeats: the unmodified model (one process) and
ringify on 2 gloo ranks (time is the slowest rank's).

Memory: a rank's peak resident set during the step minus its resident set just before
(model and inputs built): activations, gradients, buffers.
"""

from __future__ import annotations

import argparse
import os
import sys

from tabulate import tabulate

from ringify.runtime.selective_scan import ring_selective_scan
from ringify.testing import measured_step
from ringify.testing.rounds import best_of_rounds


def built(kind: str):
    """The model of ``kind``: 4 layers, hidden 256, float32."""
    import transformers as tf

    common = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, use_cache=False)  # fmt: skip
    if kind in ("hybrid", "attention only"):  # Bamba
        config = tf.BambaConfig(
            **common, attn_layer_indices=[1, 3] if kind == "hybrid" else [0, 1, 2, 3],
            mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64,
            mamba_chunk_size=256, mamba_expand=2,
        )  # fmt: skip
        config._attn_implementation = "sdpa"
        return tf.BambaForCausalLM(config)
    if kind == "qwen3.5":  # Gated DeltaNet in 3 layers of 4, as at full size
        config = tf.Qwen3_5TextConfig(
            **common, head_dim=64, linear_num_value_heads=8, linear_num_key_heads=4,
            linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
        )  # fmt: skip
        config._attn_implementation = "sdpa"
        return tf.Qwen3_5ForCausalLM(config)
    if kind == "jamba":  # Mamba1 mixers in layers 0 and 2; dense MLPs (one expert)
        config = tf.JambaConfig(
            **common, attn_layer_period=2, attn_layer_offset=1, num_experts=1,
            mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=16,
        )  # fmt: skip
        config._attn_implementation = "sdpa"
        return tf.JambaForCausalLM(config)
    raise ValueError(f"unknown model {kind!r}")


def step(impl: str, kind: str, seq: int) -> dict:
    """On every rank: one warm-up step, then one timed and measured."""
    import torch
    import torch.distributed as dist

    from ringify import ringify

    torch.manual_seed(0)
    model = built(kind)
    run = model if impl == "unmodified" else ringify(model, ring_size=dist.get_world_size())
    ids = torch.randint(0, 1024, (1, seq), generator=torch.Generator().manual_seed(1))

    def once() -> tuple[float, int, float]:
        model.zero_grad(set_to_none=True)

        def step() -> float:
            loss = run(input_ids=ids).logits.mean()
            loss.backward()
            return loss.item()

        return measured_step(step)

    once()  # warm-up: trace, allocator, communicators
    seconds, peak, loss = once()
    report = None if impl == "unmodified" else run.report()
    gathers = 0 if report is None else len(report.gathers)
    resharded = 0 if report is None else len(report.resharded)
    graph = None if report is None else run._last().module.graph
    passing = 0 if graph is None else sum(n.target is ring_selective_scan for n in graph.nodes)
    return {
        "s": seconds, "peak": peak, "loss": loss, "gathers": gathers, "resharded": resharded,
        "passing": passing,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--rings", type=int, nargs="+", default=[2])
    parser.add_argument(
        "--kinds", nargs="+", default=["hybrid", "attention only"],
        help="Bamba's 'hybrid' and 'attention only', 'qwen3.5', or 'jamba'",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--no-unmodified", action="store_true",
        help="leave the unmodified model out: ratios are to the first ring size's row",
    )  # fmt: skip
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks

    configs = [
        (kind, impl, p, seq)
        for seq in args.seqs
        for kind in args.kinds
        for impl, p in (
            *([] if args.no_unmodified else [("unmodified", 1)]),
            *(("ringify", p) for p in args.rings),
        )
    ]
    base_of = "unmodified" if not args.no_unmodified else f"P={args.rings[0]}"
    best = best_of_rounds(
        step, [(p, (impl, kind, seq)) for kind, impl, p, seq in configs], args.repeats
    )
    rows = []
    for i, (kind, impl, p, seq) in enumerate(configs):
        r = best[i]
        first = next(j for j in range(i + 1) if configs[j][0::3] == configs[i][0::3])
        base = best[first]
        rows.append({
            "S": seq,
            "model": kind,
            "run": impl if impl == "unmodified" else f"ringify P={p}",
            "gathers": r["gathers"],
            "on a share": r["resharded"],
            "state passing": r["passing"],
            "step s": round(r["s"], 2),
            f"time / {base_of}": round(r["s"] / base["s"], 3),
            "peak MiB / rank": round(r["peak"] / 2**20, 1),
            f"memory / {base_of}": round(r["peak"] / base["peak"], 3),
            f"memory / ({base_of} / P)": round(r["peak"] * p / (base["peak"] * configs[first][2]), 3),
            f"|loss - {base_of}|": f"{abs(r['loss'] - base['loss']):.1e}",
        })  # fmt: skip
    print(f"Command: python {' '.join(sys.argv)}")
    print(tabulate(rows, headers="keys", tablefmt="github"))


if __name__ == "__main__":
    main()
