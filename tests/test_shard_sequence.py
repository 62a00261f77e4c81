"""The pass on tiny modules: which nodes it rewrites, masks, kernels, fallbacks, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ringify import ringify
from ringify.passes.graph.report import AttentionRun, GatherReason, MaskKind
from ringify.runtime import ring_attention


class MaskedAttention(nn.Module):
    """Attention with a mask built inside forward from positions (as HF models do)."""

    def __init__(self, mask: str, dim=16, heads=2):
        super().__init__()
        self.mask, self.heads = mask, heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).split(c, dim=-1)
        )
        pos = torch.arange(t, device=x.device)
        offset = pos[:, None] - pos[None, :]
        if self.mask == "causal-bool":
            mask = offset >= 0
        elif self.mask == "causal-float":
            mask = torch.zeros(t, t, dtype=x.dtype).masked_fill(offset < 0, float("-inf"))
        elif self.mask == "window-float":  # additive, as HF's eager masks are
            window = (offset >= 0) & (offset < 3)
            mask = torch.where(window, x.new_zeros(()), torch.finfo(x.dtype).min)
        else:  # a sliding window of 3
            mask = (offset >= 0) & (offset < 3)
        mask = mask[None, None].expand(b, 1, t, t)
        return (
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, c)
        )


class KernelAttention(nn.Module):
    """Calls the lowered CPU flash kernel directly and uses its log-sum-exp too."""

    def forward(self, q, k, v):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        return out * lse.unsqueeze(-1).sigmoid()


class CrossAttention(nn.Module):
    def __init__(self, is_causal=False):
        super().__init__()
        self.is_causal = is_causal

    def forward(self, x, memory, mask=None):
        return F.scaled_dot_product_attention(
            x, memory, memory, attn_mask=mask, is_causal=self.is_causal
        )


def _compare(model, inputs, world):
    """Ringified vs unmodified on this rank: max difference of outputs and grads, the report."""
    torch.manual_seed(0)
    ringified = ringify(model, ring_size=world, layout="zigzag")
    results = []
    for run in (model, ringified):
        xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        for p in model.parameters():
            p.grad = None
        out = run(*xs)
        out.square().sum().backward()
        grads = [x.grad for x in xs if x.grad is not None] + [p.grad for p in model.parameters()]
        results.append((out.detach(), grads))
    (want, want_g), (got, got_g) = results
    err = max(
        [(got - want).abs().max().item()]
        + [(a - b).abs().max().item() for a, b in zip(got_g, want_g, strict=True)]
    )
    return err, ringified.report(), ringified.graph_diff()


def masked(kind, world):
    from ringify.testing.runs import quadratic_nodes

    torch.manual_seed(0)
    model = MaskedAttention(kind).double()
    length = 10 * world  # no other dim of the model has this size
    x = torch.randn(2, length, 16, dtype=torch.float64)
    err, report, diff = _compare(model, [x], world)
    ringified = ringify(model, ring_size=world, layout="zigzag")
    ringified(x)
    rewritten = report.rewritten[0]
    return (
        err,
        (rewritten.mask, rewritten.mask_shape),
        len(report.gathers),
        "ring_attention" in diff,
        quadratic_nodes(ringified, length),
    )


@pytest.mark.parametrize("kind", ["causal-bool", "causal-float", "window", "window-float"])
@pytest.mark.parametrize("world", [2, 4])
def test_masks_built_from_positions_are_programs(ranks, kind, world):
    """Bool and additive masks a model builds with arange: a program on O(S) inputs, exact,
    and no node of the rewritten graph holds S x S values."""
    for err, mask, gathers, rewritten, quadratic in ranks(world).run(masked, kind, world):
        assert err <= 1e-10 and gathers == 0 and rewritten
        assert mask == (MaskKind.PROGRAM, None)
        assert quadratic == []


def kernel_form(world):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4 * world, 8, generator=g, dtype=torch.float64) for _ in range(3))
    err, report, _ = _compare(KernelAttention(), [q, k, v], world)
    return err, len(report.rewritten), len(report.gathers)


def test_lowered_kernel_with_lse_is_rewritten(ranks):
    for err, rewritten, gathers in ranks(2).run(kernel_form, 2):
        assert (err <= 1e-10, rewritten, gathers) == (True, 1, 0)


class Latents(nn.Module):
    """Self-attention over a long sequence, then a few replicated latents (queries) attend to
    it (a Perceiver's read-out, a short decoder's cross-attention to a long encoder)."""

    def __init__(self, is_causal=False):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(1, 2, 3, 8))
        self.is_causal = is_causal

    def forward(self, x, mask=None):
        if mask is not None and mask.dtype == torch.int8:  # an additive mask made inside
            mask = torch.zeros(mask.shape, dtype=x.dtype).masked_fill(mask == 0, float("-inf"))
        memory = F.scaled_dot_product_attention(x, x, x, is_causal=True)
        queries = self.latents.expand(x.shape[0], -1, -1, -1)
        return F.scaled_dot_product_attention(
            queries, memory, memory, attn_mask=mask, is_causal=self.is_causal
        )


def latents(world, mask, is_causal=False):
    g = torch.Generator().manual_seed(0)
    length = 4 * world + 1  # padded: the padded keys must be masked out
    x = torch.randn(2, 2, length, 8, generator=g, dtype=torch.float64)
    inputs = [x]
    if mask == "bool":
        inputs.append(torch.rand(2, 1, 3, length, generator=g) < 0.6)
        inputs[-1][..., 0] = True
    elif mask == "float":  # an input that requires grad: a learned mask
        inputs.append(torch.randn(1, 2, 3, length, generator=g, dtype=torch.float64))
    elif mask == "additive":
        inputs.append((torch.rand(1, 2, 3, length, generator=g) < 0.6).to(torch.int8))
        inputs[-1][..., 0] = 1
    elif mask == "keys":
        inputs.append((torch.arange(length) < length - 3).expand(2, 1, 1, length))
    torch.manual_seed(0)
    err, report, _ = _compare(Latents(is_causal).double(), inputs, world)
    return err, [a.run for a in report.attentions], [x.reason for x in report.gathers]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mask", [None, "bool", "additive", "keys", "float"])
def test_replicated_queries_to_a_sharded_memory_merge_over_the_ring(ranks, world, mask):
    """Every query against this rank's keys, merged by log-sum-exp over the ring: no gather;
    q's gradient summed over the ring, k's and v's on the rank that holds them, a learned
    mask's (``"float"``: an input that requires grad) on the rank that holds its columns."""
    for err, runs, gathers in ranks(world).run(latents, world, mask):
        assert err <= 1e-10
        assert (runs, gathers) == ([AttentionRun.RING, AttentionRun.MEMORY], [])


def test_causal_replicated_queries_to_a_sharded_memory_are_gathered(ranks):
    for err, runs, gathers in ranks(2).run(latents, 2, None, True):
        assert err <= 1e-10
        assert (runs, gathers) == (
            [AttentionRun.RING, AttentionRun.GATHERED],
            [GatherReason.CAUSAL_MEMORY],
        )


def cross_attention(world, mask, is_causal=False):
    g = torch.Generator().manual_seed(0)
    length = 4 * world + 1  # padded: the padded query rows must not turn into NaN
    x = torch.randn(2, 2, length, 8, generator=g, dtype=torch.float64)
    memory = torch.randn(2, 2, 6, 8, generator=g, dtype=torch.float64)
    inputs = [x, memory]
    if mask == "bool":  # every row sees some keys, no two rows alike
        inputs.append(torch.rand(2, 1, length, 6, generator=g) < 0.6)
        inputs[-1][..., 0] = True
    elif mask == "float":
        inputs.append(torch.randn(1, 2, length, 6, generator=g, dtype=torch.float64))
    elif mask == "keys":  # one row for every query: broadcast, nothing to slice
        inputs.append(torch.tensor([True] * 4 + [False] * 2).expand(2, 1, 1, 6))
    err, report, _ = _compare(CrossAttention(is_causal), inputs, world)
    return err, [a.run for a in report.attentions], [x.reason for x in report.gathers]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mask", [None, "bool", "float", "keys"])
def test_cross_attention_to_a_replicated_memory_runs_locally(ranks, world, mask):
    """Each rank's queries (and mask rows) against the whole memory: no ring, no gather;
    the memory's gradient, partial on each rank, is summed."""
    for err, runs, gathers in ranks(world).run(cross_attention, world, mask):
        assert err <= 1e-10
        assert (runs, gathers) == ([AttentionRun.LOCAL], [])


def test_causal_attention_to_a_replicated_memory_is_gathered(ranks):
    """is_causal with k shorter than q puts the diagonal at the top left: run whole, exactly."""
    for err, runs, gathers in ranks(2).run(cross_attention, 2, None, True):
        assert err <= 1e-10
        assert (runs, gathers) == ([AttentionRun.GATHERED], [GatherReason.CAUSAL_MEMORY])


def test_graph_diff_dump_and_untouched_model(tmp_path, monkeypatch):
    from ringify.testing.models import NanoGPT

    monkeypatch.setenv("RINGIFY_DUMP_DIR", str(tmp_path))
    model = NanoGPT().double()
    hooks_before = dict(model._forward_pre_hooks)
    ringified = ringify(model, ring_size=1)
    idx = torch.randint(0, 64, (2, 16))
    assert torch.equal(ringified(idx), model(idx))
    diff = ringified.graph_diff()
    assert diff.count("+    ring_attention") == 2 and "-    scaled_dot_product_attention" in diff
    (folder,) = tmp_path.iterdir()
    assert {p.name for p in folder.iterdir()} == {"before.py", "after.py", "report.txt"}
    assert "ring_attention" in (folder / "after.py").read_text()
    assert str(ringified.report()) == (folder / "report.txt").read_text()
    assert dict(model._forward_pre_hooks) == hooks_before and type(model) is NanoGPT
    shared = zip(ringified.parameters(), model.parameters(), strict=True)
    assert all(a is b for a, b in shared)


def test_new_signature_retraces_under_compile():
    from ringify.testing.models import NanoGPT

    model = NanoGPT().double()
    compiled = torch.compile(ringify(model, ring_size=1), backend="aot_eager", fullgraph=True)
    for seq in (16, 24, 16):
        idx = torch.randint(0, 64, (2, seq))
        assert torch.allclose(compiled(idx), model(idx), atol=1e-12, rtol=0)


class NoAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class DataDependent(nn.Module):
    def forward(self, q):
        if q.sum() > 0:  # Python control flow on a value: torch.export cannot trace it
            return F.scaled_dot_product_attention(q, q, q)
        return q


class AttentionDropout(nn.Module):
    def forward(self, q):
        return F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)


class Attention(nn.Module):
    """Self-attention on q, k, v of any rank (SDPA takes 3-D and 5-D as well)."""

    def forward(self, q):
        return F.scaled_dot_product_attention(q, q, q)


@pytest.mark.parametrize(
    ("model", "x", "error", "match"),
    [
        (NoAttention(), (8, 4), ValueError, "found no attention.*no token input"),
        (DataDependent(), (1, 2, 8, 4), RuntimeError, "could not trace DataDependent"),
        (
            DataDependent(),
            (1, 2, 8, 4),
            RuntimeError,
            r"failed in the model at .*: if q.sum\(\) > 0",
        ),
        (AttentionDropout(), (1, 2, 8, 4), ValueError, "dropout_p=0.1.*eval mode"),
        (Attention(), (2, 8, 4), ValueError, r"\[3\]-D q, k and v; ringify shards 4-D"),
        (Attention(), (2, 3, 2, 8, 4), ValueError, r"\[5\]-D q, k and v"),
        (Attention(), (2, 2, 1, 4), ValueError, "sequence has length 1.*unmodified model"),
        (Attention(), (2, 2, 0, 4), ValueError, "empty q, k or v.*skip empty batches"),
        (Attention(), (2, 0, 8, 4), ValueError, "empty q, k or v"),
    ],
)
def test_errors_name_the_fix(model, x, error, match):
    with pytest.raises(error, match=match):
        ringify(model, ring_size=1)(torch.randn(x))


def group_not_a_process_group():
    with pytest.raises(TypeError, match=r"must be a torch\.distributed\.ProcessGroup.*got object"):
        ringify(NoAttention(), ring_size=2, group=object())
    with pytest.raises(TypeError, match=r"must be a torch\.distributed\.ProcessGroup"):
        ring_attention(*(torch.randn(1, 2, 8, 4) for _ in range(3)), group=object())
    return True


def test_group_that_is_not_a_process_group(ranks):
    assert ranks(2).run(group_not_a_process_group) == [True, True]


def test_ring_size_must_match_the_group():
    with pytest.raises(ValueError, match="ring_size=4 but the default process group has 1"):
        ringify(NoAttention(), ring_size=4)
    with pytest.raises(ValueError, match="layout must be one of"):
        ringify(NoAttention(), ring_size=1, layout="striped")
    with pytest.raises(ValueError, match="inputs must be one of"):
        ringify(NoAttention(), ring_size=1, inputs="local")


def test_transformer_decoder_mask_inspection_names_tgt_is_causal():
    """nn.TransformerDecoder called as PyTorch's docs show (tgt_mask, no tgt_is_causal) reads
    the mask's values, which torch.export cannot trace: the error says what to pass."""
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    decoder = nn.TransformerDecoder(layer, 2).double()
    tgt, memory = torch.randn(2, 8, 16, dtype=torch.float64), torch.randn(2, 8, 16).double()
    mask = nn.Transformer.generate_square_subsequent_mask(8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="pass tgt_is_causal=True"):
        ringify(decoder, ring_size=1)(tgt, memory, tgt_mask=mask)
    got = ringify(decoder, ring_size=1)(tgt, memory, tgt_mask=mask, tgt_is_causal=True)
    want = decoder(tgt, memory, tgt_mask=mask, tgt_is_causal=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


class _Doubled(torch.autograd.Function):
    """The identity, whose gradient it doubles: a backward that is not its forward's."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


class CustomBackward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, q):
        x = _Doubled.apply(self.lin(q))
        return F.scaled_dot_product_attention(x, x, x)


def custom_backward(world: int) -> dict:
    torch.manual_seed(0)
    model = CustomBackward().double()
    x = torch.randn(1, 2, 8 * world, 4, dtype=torch.float64)
    ringified, raised = ringify(model, ring_size=world), None
    try:
        ringified(x)
    except ValueError as e:
        raised = str(e)
    with torch.no_grad():  # nothing runs a backward: exact
        error = (ringified(x) - model(x)).abs().max().item()
    return {"no_grad": error, "raised": raised}


def test_a_custom_autograd_function_is_refused_where_its_backward_would_run(ranks):
    """torch.export traces an autograd.Function's forward only: with gradients, the graph's
    would be the forward's (here half the model's). Every rank refuses, naming the
    Function; without gradients the model runs, exact."""
    for r in ranks(2).run(custom_backward, 2):
        assert r["no_grad"] < 1e-12, r
        assert r["raised"] is not None and "_Doubled" in r["raised"], r
