"""``ringified.generate``: HF-compatible generation with the KV cache split across the ring.

Against the unmodified model's own ``generate``, float64, on 2 and 4 gloo ranks: the
tokens, and every step's logits (the tokens of a tiny random model alone would be weak
evidence), which HF hands to its sampler as float32: within one float32 rounding. HF Llama
plain and left-padded in a batch of 2, Mistral with a sliding window smaller than the
prompt, GPT-2, Gemma3 (sliding and full layers); sampling with the same seed. The cache
each rank holds is read: exactly its part (the prefill's chunks and its share of the new
tokens, within one entry of every other rank's), and equal to the unmodified model's
K/V at those positions (float64, 1e-10: what the decode steps computed). The decode step
is traced once for all 16 tokens.
"""

from __future__ import annotations

import pytest
import torch

from ringify.runtime.attention.spec import AttentionSpec
from ringify.testing.hf_models import gemma3, gpt2, llama, mistral
from ringify.testing.hf_moe import deepseek_v3, gpt_oss, qwen3_moe

TOL = 1e-10
PROMPT, NEW = 13, 16
MODELS = {
    "llama": lambda: llama(layers=2),
    "mistral": lambda: mistral(window=6, layers=2),
    "gpt2": lambda: gpt2(layers=2),
    "gemma3": lambda: gemma3(layers=2, window=6),  # sliding and full layers, one RoPE each
    "qwen3_moe": qwen3_moe,  # experts: router statistics off in a decode step
    "gpt_oss": lambda: gpt_oss(window=6),  # sinks in the decode step's softmax
    "deepseek_v3": deepseek_v3,  # MLA: the cache holds latents, expanded at each step
}
WINDOWED = ("mistral", "gemma3", "gpt_oss")  # their own caches keep only the window


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
    cache = ringified._generation.cache
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
    if kind not in WINDOWED:
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
        "traces": sum(step.traces for step in ringified._generation.steps.values()),
        "empty_constants": _empty_constants(ringified._generation.prefill._active.module),
    }


def _empty_constants(gm) -> int:
    """The empty tensor constants the prefill graph reads (HF's cache starts, tied to the
    device of the trace: ``passes/folds/constants.py`` leaves them out)."""
    import operator

    values = [operator.attrgetter(n.target)(gm) for n in gm.graph.nodes if n.op == "get_attr"]
    return sum(isinstance(v, torch.Tensor) and v.numel() == 0 for v in values)


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
        assert r["empty_constants"] == 0, r
    counts = results[0]["counts"]
    assert sum(counts) == results[0]["length"] and max(counts) - min(counts) <= 1, counts
    for rank, r in enumerate(results):
        assert r["counts"] == counts
        assert r["rank_entries"] == counts[rank]
        assert all(shape[2] == counts[rank] for shape in r["held"]), r  # its part, no more


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    "kind, padded",
    [
        ("llama", False),
        ("llama", True),
        ("mistral", True),
        ("gpt2", False),
        ("gemma3", True),
        ("qwen3_moe", True),
        ("gpt_oss", True),
        ("deepseek_v3", True),
    ],
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


class _KernelCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """(kernel, query heads, query rows, key heads) of every fused attention call."""

    KERNELS = (
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    )

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.KERNELS:
            q, k = args[:2]
            self.calls.append((func.__name__, q.shape[1], q.shape[2], k.shape[1]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("masked", [False, True])
def test_decode_attention_reads_the_cache_with_its_own_heads_on_cuda_kernels(dtype, masked):
    """The op's CUDA branch (any non-CPU tensor takes it) on the meta device: with GQA the
    8 query heads reach every kernel as 2 heads of 4 rows, the cache unexpanded."""
    from ringify.runtime.attention.memory_attention import decode_attention_op

    def t(*shape):
        return torch.empty(*shape, dtype=dtype, device="meta")

    keep = torch.empty(2, 1, 1, 11, dtype=torch.bool, device="meta") if masked else None
    with _KernelCalls() as log:  # the body itself: a meta tensor given to the op runs its fake
        out, _ = decode_attention_op._init_fn(
            t(2, 8, 1, 16), t(2, 2, 10, 16), t(2, 2, 10, 16), keep, [t(2, 2, 1, 16)] * 2, 11,
            AttentionSpec("", 0.25),
        )  # fmt: skip
    assert out.shape == (2, 8, 1, 16) and out.dtype == dtype
    assert len(log.calls) == 2, log.calls  # the cache's block and the new key's
    assert all((heads, rows, kv) == (2, 4, 2) for _, heads, rows, kv in log.calls), log.calls


@pytest.mark.parametrize("own_new", [False, True])
@pytest.mark.parametrize("sinks, softcap", [(False, 0.0), (True, 0.0), (False, 2.0)])
def test_decode_attention_is_sdpa_over_the_cache_and_the_new_key(own_new, sinks, softcap):
    """On one rank, float64: the op equals SDPA with GQA over the cached keys and, where this
    rank stores it, the new key, under a mask that hides some of them; with a sink logit per
    head or soft-capped scores, the definition of both (``reference.attention``)."""
    from ringify.runtime.attention.memory_attention import decode_attention_op
    from ringify.runtime.attention.reference import attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 1, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 10, 16, generator=g, dtype=torch.float64) for _ in range(2))
    k_new, v_new = (torch.randn(2, 2, 1, 16, generator=g, dtype=torch.float64) for _ in range(2))
    keep = torch.rand(2, 1, 1, 11, generator=g) > 0.3
    keep[..., -1] = True
    logits = torch.randn(1, 8, 1, 1, generator=g, dtype=torch.float64) if sinks else None
    spec = AttentionSpec("", 0.25, softcap=softcap)
    keys = 11 if own_new else 10
    out, _ = decode_attention_op(q, k, v, keep, [k_new, v_new], keys, spec, sinks=logits)
    want = attention(
        q, torch.cat([k, k_new], 2)[:, :, :keys], torch.cat([v, v_new], 2)[:, :, :keys],
        attn_mask=keep[..., :keys], scale=0.25, enable_gqa=True, sinks=logits, softcap=softcap,
    )  # fmt: skip
    assert (out - want).abs().max() < TOL


def prompts_of_three_lengths():
    import torch.distributed as dist

    from ringify import ringify

    torch.manual_seed(0)
    model = llama(layers=2).double().eval()
    ringified = ringify(model, ring_size=dist.get_world_size())
    equal = True
    for length in (13, 17, 22):
        ids = torch.randint(1, 64, (2, length), generator=torch.Generator().manual_seed(length))
        want = model.generate(ids, max_new_tokens=6, do_sample=False)
        equal &= torch.equal(ringified.generate(ids, max_new_tokens=6, do_sample=False), want)
    steps = ringified._generation.steps
    return {
        "equal": equal,
        "prefill traces": ringified._generation.prefill.traces,
        "decode traces": sum(step.traces for step in steps.values()),
    }


def test_prompts_of_new_lengths_share_the_prefill_and_decode_graphs(ranks):
    """Three prompt lengths: the prefill is traced for the first and once for all others (its
    lengths are left-padded to what the ring splits), the decode step once for all."""
    for r in ranks(2).run(prompts_of_three_lengths, timeout=300):
        assert r == {"equal": True, "prefill traces": 2, "decode traces": 1}, r
