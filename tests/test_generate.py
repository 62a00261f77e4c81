"""``ringified.generate``: HF-compatible generation with the KV cache split across the ring.

Against the unmodified model's own ``generate``, float64, on 2 and 4 gloo ranks: the
tokens, and every step's logits (the tokens of a tiny random model alone would be weak
evidence), which HF hands to its sampler as float32: within one float32 rounding. HF Llama plain and left-padded in a batch of 2, Mistral with a
sliding window smaller than the prompt, GPT-2; sampling with the same seed. The cache
each rank holds is read: exactly its part (the prefill's chunks and its share of the new
tokens, within one entry of every other rank's), and equal to the unmodified model's
K/V at those positions (float64, 1e-10: what the decode steps computed). The decode step
is traced once for all 16 tokens.
"""

from __future__ import annotations

import pytest
import torch

from ringify.testing.hf_models import gpt2, llama, mistral

TOL = 1e-10
PROMPT, NEW = 13, 16
MODELS = {
    "llama": lambda: llama(layers=2),
    "mistral": lambda: mistral(window=6, layers=2),
    "gpt2": lambda: gpt2(layers=2),
}


def _inputs(padded: bool):
    ids = torch.randint(1, 64, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :5] = 0  # a shorter first row, left-padded as HF pads a batch
    return ids, mask


def compare(kind: str, padded: bool, options: dict):
    import torch.distributed as dist

    from ringify import ringify

    torch.manual_seed(0)
    model = MODELS[kind]().double().eval()
    ids, mask = _inputs(padded)
    args = dict(max_new_tokens=NEW, return_dict_in_generate=True, output_logits=True, **options)
    torch.manual_seed(5)
    want = model.generate(ids, attention_mask=mask, **args)
    ringified = ringify(model, ring_size=dist.get_world_size())
    torch.manual_seed(5)
    got = ringified.generate(ids, attention_mask=mask, **args)
    cache = ringified._generation["cache"]
    held = [tuple(cache.keys(i).shape) for i in range(cache.layers)]
    positions = cache.positions()[:-1]
    # the unmodified model's K/V of every position the cache holds: one forward over them
    seen = want.sequences[:, :-1]
    seen_mask = torch.cat([mask, mask.new_ones(2, seen.shape[1] - PROMPT)], 1)
    where = (seen_mask.cumsum(-1) - 1).masked_fill(seen_mask == 0, 0)
    reference = model(seen, attention_mask=seen_mask, position_ids=where, use_cache=True)
    reference = reference.past_key_values
    pad = cache.length - (PROMPT + len(got.logits) - 1)  # the left padding generate added
    real = positions >= pad
    kv_error = 0.0
    if kind != "mistral":  # Mistral's own cache keeps only its window
        for i in range(cache.layers):
            for ours, theirs in ((cache.keys(i), reference.layers[i].keys),
                                 (cache.values(i), reference.layers[i].values)):  # fmt: skip
                at = positions[real] - pad
                kv_error = max(kv_error, (ours[:, :, real] - theirs[:, :, at]).abs().max().item())
    return {
        "tokens": got.sequences.tolist() == want.sequences.tolist(),
        "steps": len(got.logits) == len(want.logits),
        "logits": max(
            ((a - b).abs() / _ulp(b)).max().item()
            for a, b in zip(got.logits, want.logits, strict=True)
        ),
        "held": held,
        "counts": cache.counts,
        "rank_entries": cache.filled,
        "length": cache.length,
        "kv": kv_error,
        "traces": ringified._generation["decode_traces"],
    }


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """float32's spacing at ``x``: HF and ringify both hand float32 copies of the float64
    logits to the sampler, and two float64 values 1e-15 apart may round one ulp apart."""
    return torch.finfo(torch.float32).eps * x.abs().clamp_min(torch.finfo(torch.float32).tiny)


def _check(results: list, world: int) -> None:
    for r in results:
        assert r["tokens"] and r["steps"], r
        assert r["logits"] <= 1, r  # within one float32 rounding of the unmodified model
        assert r["kv"] < TOL, r
        assert r["traces"] == 1, r
    counts = results[0]["counts"]
    assert sum(counts) == results[0]["length"] and max(counts) - min(counts) <= 1, counts
    for rank, r in enumerate(results):
        assert r["counts"] == counts
        assert r["rank_entries"] == counts[rank]
        assert all(shape[2] == counts[rank] for shape in r["held"]), r  # its part, no more


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    "kind, padded", [("llama", False), ("llama", True), ("mistral", True), ("gpt2", False)]
)
def test_greedy_matches_the_unmodified_model(ranks, world, kind, padded):
    if world == 4 and (kind, padded) == ("llama", False):
        pytest.skip("covered by the padded batch")
    _check(ranks(world).run(compare, kind, padded, {"do_sample": False}, timeout=300), world)


def test_sampling_matches_the_unmodified_model(ranks):
    options = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)
    _check(ranks(2).run(compare, "llama", True, options, timeout=300), 2)


def refused(what: str) -> str:
    import torch.distributed as dist

    from ringify import ringify

    torch.manual_seed(0)
    model = llama(layers=1).double().eval()
    ids, _ = _inputs(False)
    kwargs = {}
    if what == "beams":
        kwargs["num_beams"] = 2
    elif what == "training":
        model.train()
    elif what == "hybrid":
        model = _bamba()
    try:
        ringify(model, ring_size=dist.get_world_size()).generate(ids, max_new_tokens=2, **kwargs)
    except ValueError as e:
        return str(e)
    return ""


def _bamba():
    from transformers import BambaConfig, BambaForCausalLM

    config = BambaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4,
        mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=16,
        mamba_expand=2, mamba_d_conv=4,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    return BambaForCausalLM(config).double().eval()


@pytest.mark.parametrize(
    "what, says",
    [
        ("beams", "does not support num_beams"),
        ("training", "eval mode"),
        ("hybrid", "DynamicCache of attention layers"),
    ],
)
def test_what_generate_cannot_do_is_said_on_every_rank(ranks, what, says):
    for message in ranks(2).run(refused, what, timeout=300):
        assert says in message, message
