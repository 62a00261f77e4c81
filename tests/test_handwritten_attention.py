"""Attention written by hand (``softmax(q @ k^T * scale + mask) @ v``) runs on the ring.

HF Llama and GPT-2 with ``attn_implementation="eager"`` (and, forward, Mistral, Qwen2, BERT,
Gemma3 and Phi3), nanoGPT's path without flash
(a causal buffer and ``masked_fill``), and ``nn.MultiheadAttention`` with its default
``need_weights=True`` (the weights are an output: every rank computes its query rows of
them against the whole keys). Against the unmodified model on 2 and 4 ranks, float64,
eager and compiled: outputs, every parameter gradient, and the report (every attention a
ring, the gathers expected).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ringify import ringify
from ringify.passes.folds.handwritten import UNREAD_NOTE, fold_handwritten_attention
from ringify.passes.folds.spellings import fold_synonyms
from ringify.passes.graph.report import AttentionRun, GatherReason
from ringify.runtime.attention import reference
from ringify.testing.runs import inductor_control, ringified_run
from ringify.testing.tolerance import inductor_bound, rounding

TOL = 1e-10
aten = torch.ops.aten


class SelfAttention(nn.Module):
    """``nn.MultiheadAttention`` as torch.nn users call it: weights returned (averaged over
    heads), a causal float mask given as an input, batch first."""

    def __init__(self, dim=32, heads=4, return_weights=True):
        super().__init__()
        self.return_weights = return_weights
        self.norm = nn.LayerNorm(dim)
        self.attention = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x, mask):
        y = self.norm(x)
        out, weights = self.attention(y, y, y, attn_mask=mask)
        return (x + out, weights) if self.return_weights else (x + out,)


class Spelled(nn.Module):
    """Three layers of causal attention by hand, each spelling the keys' transpose its own
    way: ``k.mT``; einsum over (batch, seq, heads, dim) with no transpose at all; ``permute``
    under a tanh soft cap (Gemma 2's)."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(3))

    def forward(self, x):
        b, s, d = x.shape
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        for i, qkv in enumerate(self.qkv):
            q, k, v = qkv(x).view(b, s, 3, self.heads, -1).unbind(2)  # (b, s, h, e)
            scale = q.shape[-1] ** -0.5
            if i == 1:
                scores = torch.einsum("bihe,bjhe->bhij", q, k) * scale
            else:
                q, k, v = (t.transpose(1, 2) for t in (q, k, v))
                keys = k.mT if i == 0 else k.permute(0, 1, 3, 2)
                scores = q @ keys * scale
            if i == 2:
                scores = torch.tanh(scores / 5.0) * 5.0
            p = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            y = torch.einsum("bhij,bjhe->bihe", p, v) if i == 1 else (p @ v).transpose(1, 2)
            x = x + y.reshape(b, s, d)
        return (x,)


def _case(name: str, length: int):
    """(model, args, kwargs, the outputs to compare)."""
    from ringify.testing import hf_models, models

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (2, length), generator=g)
    if name in ("llama", "llama_padded", "gpt2", "gpt2_attentions"):
        build = hf_models.gpt2 if name.startswith("gpt2") else hf_models.llama
        kwargs = {"input_ids": ids, "labels": ids}  # the loss: in float32 (HF), held apart
        if name == "llama_padded":  # right padding of the second sequence
            mask = torch.ones(2, length, dtype=torch.long)
            mask[1, length - 3 :] = 0
            kwargs["attention_mask"] = mask
        if name == "gpt2_attentions":  # output_attentions=True: the maps are outputs
            kwargs["output_attentions"] = True
            return (
                build(attn_implementation="eager"),
                (),
                kwargs,
                lambda o: (o.logits, *o.attentions),
            )
        return build(attn_implementation="eager"), (), kwargs, lambda o: (o.logits,)
    if name == "nanogpt":
        model = models.NanoGPT(attend=models.AttentionByHand())
        return model, (ids, ids), {}, None
    if name == "spelled":
        return Spelled(), (torch.randn(2, length, 16, generator=g, dtype=torch.float64),), {}, None
    if name == "mha_discarded":  # the weights computed (need_weights=True), then dropped
        x = torch.randn(2, length, 32, generator=g, dtype=torch.float64)
        return SelfAttention(return_weights=False), (x, None), {}, None
    if name == "mha":
        mask = torch.nn.Transformer.generate_square_subsequent_mask(length, dtype=torch.float64)
        x = torch.randn(2, length, 32, generator=g, dtype=torch.float64)
        return SelfAttention(), (x, mask), {}, None
    raise ValueError(name)


def _run(model, fn, args, kwargs, pick):
    """Outputs and parameter gradients of a fixed random projection of the outputs; HF's
    loss apart (it runs in float32 even in a float64 model)."""
    model.zero_grad(set_to_none=True)
    result = fn(*args, **kwargs)
    loss = getattr(result, "loss", None)
    outs = pick(result) if pick else result
    g = torch.Generator().manual_seed(2)
    total = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outs)
    total.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return [o.detach() for o in outs], grads, None if loss is None else loss.item()


def compare(name: str, length: int, backend: str | None = None):
    """On every rank: the largest differences from the unmodified model (and, for HF, from
    its SDPA spelling), how each attention ran, the gathers."""

    model, args, kwargs, pick = _case(name, length)
    model = model.double()
    want = _run(model, model, args, kwargs, pick)
    exact = want
    if hasattr(model, "config"):  # HF's eager softmax runs in float32 even in a float64 model
        model.config._attn_implementation = _exact_implementation(name)
        exact = _run(model, model, args, kwargs, pick)
        model.config._attn_implementation = "eager"
    ringified, run = ringified_run(model, backend)
    got = _run(model, run, args, kwargs, pick)
    assert set(got[1]) == set(want[1]), "every parameter gets a gradient"
    report = ringified.report()
    control = inductor_control(model, backend)  # Inductor's own move: the bound under it
    return {
        "bound": inductor_bound(_largest(_run(model, control, args, kwargs, pick), want))
        if control is not None
        else TOL,
        "exact": _largest(got, exact),
        "unmodified": _largest(got, want),
        "own": _largest(exact, want),  # the unmodified model's own eager / SDPA difference
        "loss": None if want[2] is None else abs(got[2] - want[2]) / abs(want[2]),
        "runs": [a.run for a in report.attentions],
        "forms": [a.form for a in report.attentions],
        "gathers": [x.reason for x in report.gathers],
    }


def _exact_implementation(name: str) -> str:
    """What an HF model's hand-written attention means in the model's dtype: SDPA; GPT-2's
    own eager path for its maps (SDPA gives none; its softmax runs in the model's dtype,
    where Llama's runs in float32)."""
    return "eager" if name == "gpt2_attentions" else "sdpa"


def _largest(got, want) -> float:
    outs = [(a - b).abs().max().item() for a, b in zip(got[0], want[0], strict=True)]
    return max(outs + [(got[1][n] - want[1][n]).abs().max().item() for n in want[1]])


def _matches(r) -> bool:
    """Exact against the SDPA reading, and no farther from the unmodified model than its
    own SDPA spelling is; HF's float32 loss within float32's rounding."""
    loss = r["loss"] is None or r["loss"] <= rounding(torch.float32)
    return r["exact"] <= r["bound"] and r["unmodified"] <= 2 * r["own"] + r["bound"] and loss


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    ("name", "length"), [("llama", 16), ("llama_padded", 13), ("gpt2", 16), ("nanogpt", 12)]
)
def test_matches_unmodified_model_without_gathers(ranks, world, name, length):
    for r in ranks(world).run(compare, name, length):
        assert r["runs"] == [AttentionRun.RING] * 2, r
        assert r["forms"] == ["by hand"] * 2
        assert r["gathers"] == [], r["gathers"]
        assert _matches(r), r


@pytest.mark.parametrize("world", [2, 3, 4])
def test_spellings_of_the_keys_transpose(ranks, world):
    """``k.mT``, an einsum with no transpose, ``permute`` under a soft cap: each a ring."""
    for r in ranks(world).run(compare, "spelled", 6 * world):
        assert r["runs"] == [AttentionRun.RING] * 3, r
        assert r["forms"] == ["by hand"] * 2 + ["by hand, soft-capped"], r["forms"]
        assert r["gathers"] == [], r["gathers"]
        assert _matches(r), r


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("name", "attentions"), [("mha", 1), ("gpt2_attentions", 2)])
def test_weights_are_an_output(ranks, world, name, attentions):
    """need_weights=True, output_attentions=True: the output on the ring, each rank's query
    rows of the weights from the whole keys (a gather of k per attention, reported)."""
    for r in ranks(world).run(compare, name, 12):
        assert r["runs"] == [AttentionRun.RING] * attentions, r
        assert r["forms"] == ["by hand, probabilities an output"] * attentions
        assert r["gathers"] == [GatherReason.WHOLE_FACTOR] * attentions, r["gathers"]
        assert _matches(r), r


def test_weights_computed_and_dropped(ranks):
    for r in ranks(2).run(compare, "mha_discarded", 12):
        assert r["forms"] == ["by hand"], r
        assert r["gathers"] == [], r["gathers"]
        assert _matches(r), r


@pytest.mark.parametrize(
    ("name", "backend"),
    [(n, "aot_eager") for n in ("llama", "nanogpt", "mha", "spelled")]
    + [("spelled", "inductor")],  # every spelling of the by-hand forms (the slow pass)
)
def test_compiled_matches_unmodified_model(ranks, name, backend):
    for r in ranks(2).run(compare, name, 12, backend, timeout=900):
        assert AttentionRun.RING in r["runs"], r
        assert _matches(r), r


class _Function(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _fold(fn, *shapes, dtype=torch.float64):
    """The exported graph of ``fn`` on inputs of ``shapes``, after the fold (and the one of
    spellings before it, as the pipeline runs them); how many it folded."""
    inputs = [torch.randn(s, dtype=dtype) for s in shapes]
    gm = torch.export.export(_Function(fn), tuple(inputs), strict=False).module()
    fold_synonyms(gm)
    return gm, inputs, fold_handwritten_attention(gm)


def _tril(q, k):
    return torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()


sdpa = torch.nn.functional.scaled_dot_product_attention
# spelling -> (the hand-written attention, what it means in SDPA's terms)
SPELLINGS = {
    "scale after": (
        lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1) * 0.5, -1) @ v,
        lambda q, k, v: sdpa(q, k, v, scale=0.5),
    ),
    "scale before": (
        lambda q, k, v: torch.softmax((q * 0.5) @ k.transpose(2, 3), -1) @ v,
        lambda q, k, v: sdpa(q, k, v, scale=0.5),
    ),
    "divided": (
        lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2) / 3.0, dim=-1) @ v,
        lambda q, k, v: sdpa(q, k, v, scale=1 / 3.0),
    ),
    "upcast": (  # the model's softmax in float32 (below float64): SDPA's is in q's dtype
        lambda q, k, v: (
            torch.softmax((q @ k.transpose(-2, -1)).float(), -1, dtype=torch.float32).to(q.dtype)
            @ v
        ),
        lambda q, k, v: sdpa(q, k, v, scale=1.0),
    ),
    "hidden by -inf": (
        lambda q, k, v: (
            torch.softmax((q @ k.transpose(-2, -1)).masked_fill(~_tril(q, k), float("-inf")), -1)
            @ v
        ),
        lambda q, k, v: sdpa(q, k, v, attn_mask=_tril(q, k), scale=1.0),
    ),
    "kept by where, the dtype's minimum": (
        lambda q, k, v: (
            torch.softmax(
                torch.where(_tril(q, k), q @ k.transpose(-2, -1), torch.finfo(q.dtype).min), -1
            )
            @ v
        ),
        lambda q, k, v: sdpa(q, k, v, attn_mask=_tril(q, k), scale=1.0),
    ),
    "a bool mask added (its 0 and 1 added to the scores)": (
        lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1) + _tril(q, k), -1) @ v,
        lambda q, k, v: sdpa(q, k, v, attn_mask=_tril(q, k).to(q.dtype), scale=1.0),
    ),
    "einsum": (
        lambda q, k, v: torch.einsum(
            "bhij,bhjd->bhid", torch.einsum("bhid,bhjd->bhij", q, k).mul(0.5).softmax(-1), v
        ),
        lambda q, k, v: sdpa(q, k, v, scale=0.5),
    ),
    # the same transpose of the keys, as models spell it
    "k.mT": (
        lambda q, k, v: torch.softmax(q @ k.mT * 0.5, -1) @ v,
        lambda q, k, v: sdpa(q, k, v, scale=0.5),
    ),
    "k.swapaxes": (
        lambda q, k, v: torch.softmax(q @ k.swapaxes(-1, -2) * 0.5, -1) @ v,
        lambda q, k, v: sdpa(q, k, v, scale=0.5),
    ),
    "k.permute": (
        lambda q, k, v: torch.softmax(q @ k.permute(0, 1, 3, 2) * 0.5, -1) @ v,
        lambda q, k, v: sdpa(q, k, v, scale=0.5),
    ),
    "einsum of the keys transposed": (
        lambda q, k, v: torch.einsum(
            "bhij,bhjd->bhid", torch.einsum("bhid,bhdj->bhij", q, k.mT).mul(0.5).softmax(-1), v
        ),
        lambda q, k, v: sdpa(q, k, v, scale=0.5),
    ),
    "einsum in (batch, seq, heads, dim)": (
        lambda q, k, v: torch.einsum(
            "bhij,bjhd->bihd",
            torch.einsum("bihd,bjhd->bhij", q.transpose(1, 2), k.transpose(1, 2))
            .mul(0.5)
            .softmax(-1),
            v.transpose(1, 2),
        ).transpose(1, 2),
        lambda q, k, v: sdpa(q, k, v, scale=0.5),
    ),
    "soft cap, k.mT": (
        lambda q, k, v: torch.softmax(torch.tanh(q @ k.mT * 0.5 / 3.0) * 3.0, -1) @ v,
        lambda q, k, v: reference.attention(q, k, v, scale=0.5, softcap=3.0),
    ),
    "soft cap, einsum": (
        lambda q, k, v: torch.einsum(
            "bhij,bhjd->bhid",
            (torch.tanh(torch.einsum("bhid,bhjd->bhij", q, k) * 0.5 / 3.0) * 3.0).softmax(-1),
            v,
        ),
        lambda q, k, v: reference.attention(q, k, v, scale=0.5, softcap=3.0),
    ),
    "3-D bmm": (
        lambda q, k, v: torch.bmm(
            torch.softmax(torch.bmm(q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2)), -1),
            v.flatten(0, 1),
        ),
        lambda q, k, v: sdpa(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), scale=1.0),
    ),
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_spellings_become_one_sdpa_with_the_same_meaning(spelling):
    fn, meaning = SPELLINGS[spelling]
    gm, inputs, folded = _fold(fn, (2, 3, 8, 4), (2, 3, 8, 4), (2, 3, 8, 4))
    assert folded == 1
    gm.recompile()
    targets = {n.target for n in gm.graph.nodes}
    assert not targets & {aten.softmax.int, aten.matmul.default, aten.einsum.default}
    torch.testing.assert_close(gm(*inputs), meaning(*inputs), rtol=0, atol=1e-14)
    torch.testing.assert_close(gm(*inputs), fn(*inputs), rtol=0, atol=1e-6)
    assert all("val" in n.meta for n in gm.graph.nodes if n.op == "call_function")


def test_what_is_not_attention_stays_and_says_why():
    """A mask filled with a finite value other than the dtype's minimum would change rows
    with nothing kept; scores scaled after their mask would scale the mask."""

    def finite_fill(q, k, v):
        hidden = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1)
        return torch.softmax((q @ k.transpose(-2, -1)).masked_fill(hidden, -1e4), -1) @ v

    def scaled_mask(q, k, v):
        return torch.softmax(((q @ k.transpose(-2, -1)) + q.sum()) * 0.5, -1) @ v

    def transposed_einsum(q, k, v):  # the scores' rows are the keys: not q k^T
        return torch.einsum("bhij,bhjd->bhid", torch.einsum("bhid,bhjd->bhji", q, k).softmax(-1), v)

    cases = ((finite_fill, "filled with"), (scaled_mask, "scaled after"))
    for fn, why in (*cases, (transposed_einsum, "einsum")):
        gm, _, folded = _fold(fn, (1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 8, 4))
        assert folded == 0
        (softmax,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.softmax.int]
        assert why in softmax.meta[UNREAD_NOTE]


class FiniteFill(nn.Module):
    def forward(self, q):
        hidden = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).triu(1)
        return torch.softmax((q @ q.transpose(-2, -1)).masked_fill(hidden, -1e4), -1) @ q


class ScoreModFlex(nn.Module):
    """FlexAttention with a ``score_mod`` (a tanh soft cap), which ringify does not read yet."""

    def forward(self, q):
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, q, q, score_mod=lambda s, b, h, i, j: 30 * torch.tanh(s / 30))


def test_errors_name_the_way_out():
    """No attention read: the error says why each softmax was not, and the one-line fixes.
    (A model with no attention at all, Mamba, is sharded from its token ids: test_hybrid.py.)"""
    with pytest.raises(ValueError, match=r"filled with -10000.*attn_implementation=\"sdpa\""):
        ringify(FiniteFill(), ring_size=1)(torch.randn(1, 2, 8, 4))
    with pytest.raises(ValueError, match=r"FlexAttention.*score_mod.*attn_implementation"):
        ringify(ScoreModFlex(), ring_size=1)(torch.randn(1, 2, 256, 8))  # (no grad: CPU flex)
    from ringify.testing.models import AttentionByHand, NanoGPT

    attend = AttentionByHand()
    attend.drop.p = 0.1  # attention dropout in training: refused, as for SDPA
    with pytest.raises(ValueError, match=r"dropout_p=0.1.*eval mode"):
        ringify(NanoGPT(attend=attend).train(), ring_size=1)(torch.randint(0, 64, (1, 8)))


def eager_family(name: str):
    """An HF family's eager attention (no gradients): the ringified outputs against the
    model's SDPA reading, and how each attention ran."""
    import transformers as hf

    torch.manual_seed(0)
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    shape |= {"num_attention_heads": 4, "vocab_size": 64}
    gqa = {"num_key_value_heads": 2, "head_dim": 8}
    config, model_class = {
        "mistral": (lambda: hf.MistralConfig(**shape, **gqa, sliding_window=8), hf.MistralForCausalLM),
        "qwen2": (lambda: hf.Qwen2Config(**shape, num_key_value_heads=2), hf.Qwen2ForCausalLM),
        "bert": (lambda: hf.BertConfig(**shape), hf.BertModel),
        "gemma3": (lambda: hf.Gemma3TextConfig(**shape, **gqa, sliding_window=8), hf.Gemma3ForCausalLM),
        "phi3": (lambda: hf.Phi3Config(**shape, num_key_value_heads=2, pad_token_id=0), hf.Phi3ForCausalLM),
    }[name]  # fmt: skip
    config = config()
    config.use_cache, config._attn_implementation = False, "sdpa"
    model = model_class(config).double().eval()
    ids = torch.randint(1, 64, (2, 24), generator=torch.Generator().manual_seed(1))

    def out(o):
        return o.logits if hasattr(o, "logits") else o.last_hidden_state

    with torch.no_grad():
        exact = out(model(input_ids=ids))
        model.config._attn_implementation = "eager"
        ringified, run = ringified_run(model)
        got = out(run(input_ids=ids))
    report = ringified.report()
    return {
        "diff": (got - exact).abs().max().item(),
        "forms": [(a.run, a.form) for a in report.attentions],
        "gathers": report.gathers,
    }


@pytest.mark.parametrize("name", ["mistral", "qwen2", "bert", "gemma3", "phi3"])
def test_hf_eager_families(ranks, name):
    """Mistral's window, Gemma3's local and global layers, BERT's encoder, Qwen2, Phi3."""
    for r in ranks(2).run(eager_family, name):
        assert r["forms"] == [(AttentionRun.RING, "by hand")] * 2 and r["gathers"] == (), r
        assert r["diff"] <= TOL, r
