"""HF's default ``use_cache=True``: ignored in training (said once), returned in eval.

HF Llama built with its default config (``use_cache=True``) on 2 and 4 ranks, float64,
against the unmodified model: in training the logits and every parameter gradient, with
no cache returned; in eval the cache itself, gathered whole with ``outputs="full"`` and
this rank's part with ``outputs="sharded"``.
"""

from __future__ import annotations

import pytest
import torch

from ringify.testing.runs import ringified_run

TOL = 1e-10


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    assert config.use_cache, "HF's default"
    return LlamaForCausalLM(config).double()


def _ids(length: int) -> torch.Tensor:
    return torch.randint(1, 64, (2, length), generator=torch.Generator().manual_seed(1))


def training(length: int, backend: str | None):
    model = _llama().train()
    ids = _ids(length)
    weights = torch.randn(2, length, 64, generator=torch.Generator().manual_seed(2))

    def step(fn):
        model.zero_grad(set_to_none=True)
        out = fn(input_ids=ids)
        (out.logits * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return out, grads

    want, want_grads = step(model)
    assert want.past_key_values is not None, "the unmodified model builds a cache"
    ringified, run = ringified_run(model, backend)
    got, got_grads = None, None
    for _ in range(2):  # warned once, not per call
        got, got_grads = step(run)
    return {
        "logits": (got.logits - want.logits).abs().max().item(),
        "grads": max((got_grads[n] - want_grads[n]).abs().max().item() for n in want_grads),
        "cache": got.past_key_values,
        "warned": sorted(ringified._warned),
    }


@pytest.mark.parametrize(("world", "backend"), [(2, None), (4, None), (2, "aot_eager")])
def test_training_ignores_the_cache(ranks, world, backend):
    for r in ranks(world).run(training, 12, backend):
        assert r["logits"] <= TOL and r["grads"] <= TOL, r
        assert r["cache"] is None
        assert r["warned"] == ["use_cache"]


def evaluation(length: int, outputs: str):
    import torch.distributed as dist

    from ringify.runtime import shard

    model = _llama().eval()
    ids = _ids(length)
    with torch.no_grad():
        want = model(input_ids=ids).past_key_values
        got = ringified_run(model, outputs=outputs)[1](input_ids=ids).past_key_values
    diffs, shapes = [], []
    for layer in range(len(want.layers)):
        for name in ("keys", "values"):
            full = getattr(want.layers[layer], name)
            if outputs == "sharded":
                full = shard(full, 2, group=dist.group.WORLD, layout="zigzag")
            part = getattr(got.layers[layer], name)
            shapes.append(tuple(part.shape))
            diffs.append((part - full).abs().max().item())
    return {"diff": max(diffs), "shapes": set(shapes), "type": type(got).__name__}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("outputs", ["full", "sharded"])
def test_evaluation_returns_the_cache(ranks, world, outputs):
    length = 16
    for r in ranks(world).run(evaluation, length, outputs):
        assert r["type"] == "DynamicCache"
        assert r["diff"] <= TOL, r
        part = length if outputs == "full" else length // world
        assert r["shapes"] == {(2, 2, part, 8)}


def handoff(length: int, new: int):
    """The handoff of the README: the ringified prefill of all but the prompt's last token,
    then the unmodified model's ``generate`` from that cache; and ringify's own generate."""
    model = _llama().eval()
    ids = _ids(length)[:1]
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=new, do_sample=False)
        ringified = ringified_run(model)[0]
        prefill = ringified(input_ids=ids[:, :-1], use_cache=True, logits_to_keep=1)
        got = model.generate(
            ids, past_key_values=prefill.past_key_values, max_new_tokens=new, do_sample=False
        )
        sharded = ringified.generate(ids, max_new_tokens=new, do_sample=False)
    return {
        "equal": torch.equal(got, want) and torch.equal(sharded, want),
        "logits": tuple(prefill.logits.shape),
        "warned": sorted(ringified._warned),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_prefill_hands_its_cache_to_generate(ranks, world):
    for r in ranks(world).run(handoff, 16, 6):
        assert r["equal"], r
        assert r["logits"] == (1, 1, 64)
        assert r["warned"] == []


def test_a_cache_ringify_cannot_return_is_named():
    """A hybrid's cache (Bamba: attention K/V and Mamba states) in eval: a clear error."""
    from transformers import BambaConfig, BambaForCausalLM

    from ringify import ringify

    config = BambaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4,
        mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=16,
    )  # fmt: skip
    model = BambaForCausalLM(config).eval()
    fix = r"KV cache ringify cannot return.*use_cache=False"
    with pytest.raises(RuntimeError, match=fix), torch.no_grad():
        ringify(model, ring_size=1)(input_ids=torch.randint(1, 64, (1, 32)), use_cache=True)
