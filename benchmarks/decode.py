"""Long prompts then new tokens: per-rank memory, cache, time per token and bytes, ringify's generate.

    python benchmarks/decode.py --seqs 32768 131072 --rings 2 4 --new 32

HF Llama (2 layers, hidden 64, 4 heads on 2 kv heads, head dim 16, float32, batch 1),
greedy. ``unmodified``: one process, the model's prefill (``use_cache=True``,
``logits_to_keep=1``) then a decode loop of single-token forwards over its
``DynamicCache``, as HF's ``generate`` runs it. ``ringify P=n``: ``ringified.generate``'s
two phases (``ringify.generation.loop.prefill`` and ``decode``) on n gloo ranks: the
ringified prefill keeps each rank's part of the cache; each new token is one decode step
(traced once, in the prefill phase) that merges the ranks' attention by log-sum-exp.

Per rank (the largest over ranks): the peak resident set above the start of each phase
(the prefill's includes ringify's trace), the bytes of K/V the rank holds after the last
token, seconds per decode token, and the bytes of the decode's collectives per step (from
their shapes: two all-reduces per layer, of (B, H, 1) and (B, H, 1, D + 1) float32; a ring
all-reduce sends about twice its payload). This machine has 2 cores: at ring 4 the ranks
share them, so its times are not a scaling figure.
"""

from __future__ import annotations

import argparse
import os
import sys

from tabulate import tabulate

from ringify.testing import measured_step
from ringify.testing.ranks import RankPool

LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB = 2, 64, 4, 2, 256


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=1 << 20, eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def unmodified(seq: int, new: int) -> dict:
    import torch

    model = _model()
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        t_pre, peak_pre, out = measured_step(
            lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1)
        )
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        del out
        tokens = [token]

        def loop():
            nonlocal token
            for i in range(new - 1):
                position = torch.tensor([[seq + i]])
                out = model(input_ids=token, past_key_values=cache, position_ids=position)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                tokens.append(token)

        t_dec, peak_dec, _ = measured_step(loop)
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    return _row(t_pre, peak_pre, t_dec / (new - 1), peak_dec, held, torch.cat(tokens, 1), 0, 0)


def ringified(seq: int, new: int) -> dict:
    import torch
    import torch.distributed as dist

    from ringify import ringify
    from ringify.generation import loop

    model = _model()
    ring = ringify(model, ring_size=dist.get_world_size())
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(1))
    config = loop._generation_config(model, {"max_new_tokens": new, "do_sample": False})
    t_pre, peak_pre, started = measured_step(lambda: loop.prefill(ring, ids, None, new, 0))
    t_dec, peak_dec, sequences = measured_step(lambda: loop.decode(ring, started, config, new))
    held = started.cache.nbytes()
    sent = 4 * LAYERS * HEADS * (HIDDEN // HEADS + 2)  # per step: (B, H, 1) + (B, H, 1, D + 1)
    traces = sum(step.traces for step in ring._generation.steps.values())
    return _row(
        t_pre, peak_pre, t_dec / (new - 1), peak_dec, held, sequences[:, seq:], sent, traces
    )


def _row(t_pre, peak_pre, per_token, peak_dec, held, tokens, sent, traces) -> dict:
    return {
        "s": t_pre, "peak": peak_pre, "token_s": per_token, "peak_dec": peak_dec,
        "held": held, "tokens": tokens.tolist(), "sent": sent, "traces": traces,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--rings", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--new", type=int, default=32)
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks
    rows = []
    for seq in args.seqs:
        pool = RankPool(1)
        base = pool.run(unmodified, seq, args.new, timeout=3600)[0]
        pool.close()
        rows.append(_table_row(seq, "unmodified", base, base, 1))
        for p in args.rings:
            pool = RankPool(p)
            ranks = pool.run(ringified, seq, args.new, timeout=3600)
            pool.close()
            worst = ranks[0] | {
                k: max(r[k] for r in ranks) for k in ("s", "peak", "token_s", "peak_dec", "held")
            }
            rows.append(_table_row(seq, f"ringify P={p}", worst, base, p))
    print(f"Command: python {' '.join(sys.argv)}")
    print(tabulate(rows, headers="keys", tablefmt="github"))


def _table_row(seq: int, run: str, r: dict, base: dict, p: int) -> dict:
    mib = 2**20
    return {
        "prompt": seq,
        "run": run,
        "prefill s": round(r["s"], 1),
        "prefill peak MiB": round(r["peak"] / mib, 1),
        "prefill peak / unmodified": round(r["peak"] / base["peak"], 3),
        "cache MiB held": round(r["held"] / mib, 2),
        "cache / unmodified": round(r["held"] / base["held"], 3),
        "decode peak MiB": round(r["peak_dec"] / mib, 2),
        "ms / token": round(1000 * r["token_s"], 1),
        "bytes / step": r["sent"],
        "decode traces": r["traces"],
        "tokens equal": r["tokens"] == base["tokens"],
    }


if __name__ == "__main__":
    main()
