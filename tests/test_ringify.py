"""ringify(model) against the unmodified model: outputs, loss, every gradient, 1/2/4 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ringify import ringify
from ringify.passes.graph.report import AttentionRun, MaskKind
from ringify.testing.hf_models import falcon, gpt2, llama, t5
from ringify.testing.models import (
    BiasedAttention,
    NanoGPT,
    RunningModel,
    transformer_encoder,
)
from ringify.testing.runs import inductor_control, quadratic_nodes
from ringify.testing.tolerance import inductor_bound


def _build(name: str, dtype, seq: int = 0):
    torch.manual_seed(0)
    model = {
        "t5-encoder": lambda: t5(encoder_only=True),
        "t5": t5,
        "biased": lambda: BiasedAttention(seq),
        "falcon-mqa": lambda: falcon(new_decoder_architecture=False),
        "falcon-new-decoder": lambda: falcon(new_decoder_architecture=True),
        "nanogpt": NanoGPT,
        "encoder": transformer_encoder,
        "encoder-padding": transformer_encoder,
        "gpt2": gpt2,
        "gpt2-padding": gpt2,
        "llama": llama,
        "llama-shift": llama,
        "llama-left-padding": llama,
        "cumsum": RunningModel,
        "cummax": lambda: RunningModel("cummax"),
        "pool": lambda: RunningModel("pool"),
        "softmax": lambda: RunningModel("softmax"),
        "argmax": lambda: RunningModel("argmax"),
        "take": lambda: RunningModel("take"),
    }[name]().to(dtype)
    g = torch.Generator().manual_seed(1)
    return model, g


def _inputs(name: str, seq: int, dtype, g):
    if name == "nanogpt":
        idx, targets = (
            torch.randint(0, 64, (2, seq), generator=g),
            torch.randint(0, 64, (2, seq), generator=g),
        )
        targets[0, :3] = -1  # ignored positions
        return (idx, targets), {}
    if name.startswith("t5"):
        ids = torch.randint(1, 64, (2, seq), generator=g)
        if name == "t5-encoder":
            return (), {"input_ids": ids}
        return (), {"input_ids": ids, "labels": torch.randint(1, 64, (2, seq), generator=g)}
    if name.startswith(("gpt2", "llama", "falcon")):
        ids, labels = (
            torch.randint(0, 64, (2, seq), generator=g),
            torch.randint(0, 64, (2, seq), generator=g),
        )
        labels[1, -4:] = -100
        if name in ("gpt2-padding", "llama-left-padding"):  # the second sequence is padded
            mask = torch.ones(2, seq, dtype=torch.long)
            mask[1, slice(None, 5) if name.endswith("left-padding") else slice(-5, None)] = 0
            return (), {"input_ids": ids, "labels": labels, "attention_mask": mask}
        if name == "llama-shift":  # HF's shift_labels, as a trainer passes them (the loss's)
            shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
            return (), {"input_ids": ids, "labels": labels, "shift_labels": shift}
        return (), {"input_ids": ids, "labels": labels}
    dim = 32 if name.startswith("encoder") else 16  # the others take embeddings
    if name == "encoder-padding":  # nn.MultiheadAttention's key padding: a (B, H, 1, S) mask
        padding = torch.zeros(2, seq, dtype=torch.bool)
        padding[1, -5:] = True
        x = torch.randn(2, seq, dim, generator=g, dtype=dtype).requires_grad_()
        return (x,), {"src_key_padding_mask": padding}
    return (torch.randn(2, seq, dim, generator=g, dtype=dtype).requires_grad_(),), {}


def _split(out):
    """(logits, the model's own loss or None) from any of the models' outputs."""
    if hasattr(out, "logits"):
        return out.logits, out.loss
    if hasattr(out, "last_hidden_state"):
        return out.last_hidden_state, None
    return (out[0], out[1]) if isinstance(out, tuple) else (out, None)


def _forward_backward(run, model, args, kwargs, through_logits=True):
    """``run`` (the model or a wrapper of it) forward and backward; grads read off ``model``.

    The backward goes through the model's loss and, with ``through_logits``, the logits.
    """
    for p in model.parameters():
        p.grad = None
    args = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)
    logits, model_loss = _split(run(*args, **kwargs))
    # Backward through every output: the model's loss and the logits.
    loss = (logits.square().mean() if through_logits else 0) + (
        0 if model_loss is None else model_loss
    )
    loss.backward()
    loss = loss if model_loss is None else model_loss
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    inputs = [a.grad for a in args if a.requires_grad]
    return logits.detach(), loss.detach(), grads, inputs


def _differences(got, want) -> dict[str, float]:
    """The largest differences of the logits, the loss and the parameters' gradients."""
    return {
        "logits": (got[0] - want[0]).abs().max().item(),
        "loss": _loss_difference(got[1], want[1]),
        "grads": max((got[2][n] - want[2][n]).abs().max().item() for n in want[2]),
    }


def compare(name, seq, dtype, layout, compile_backend=None, strategy="auto"):
    """On every rank: ringified vs unmodified, the largest differences of each kind."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    model, g = _build(name, dtype, seq)
    args, kwargs = _inputs(name, seq, dtype, g)
    want = _forward_backward(model, model, args, kwargs)
    ringified = ringify(model, ring_size=world, layout=layout, strategy=strategy)
    run = ringified
    if compile_backend:
        torch._dynamo.reset()
        run = torch.compile(ringified, backend=compile_backend, fullgraph=True)
    got = _forward_backward(run, model, args, kwargs)
    report = ringified.report()
    assert set(got[2]) == set(want[2]), "every parameter gets a gradient"
    tolerances = dict.fromkeys(("logits", "loss", "grads"), TOL[torch.float64])
    if compile_backend == "inductor":
        # Inductor fuses what a model computes in float32 (HF's loss, T5's variance) in
        # another order than eager: the unmodified model's own move under Inductor,
        # measured here, sets the bound (ringify.testing.tolerance)
        control = inductor_control(model, compile_backend)
        moved = _differences(_forward_backward(control, model, args, kwargs), want)
        tolerances = {k: inductor_bound(moved[k]) for k in tolerances}
    return {
        **_differences(got, want),
        "tolerances": tolerances,
        "inputs": max(
            [(a - b).abs().max().item() for a, b in zip(got[3], want[3], strict=True)] or [0.0]
        ),
        "rewritten": len(report.rewritten),
        "runs": [a.run for a in report.rewritten],
        "masks": [(a.mask, a.mask_shape) for a in report.rewritten],
        "gathers": [(x.op, x.reason) for x in report.gathers],
        "resharded": [(x.entered, x.gathered) for x in report.resharded],
        "gather_details": [x.detail for x in report.gathers],
        "quadratic": quadratic_nodes(ringified, seq),
    }


TOL = {torch.float64: 1e-10}


def _loss_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """The loss's difference on the float64 scale. HF computes its loss in float32
    (logits.float()) whatever the model's dtype: such a loss is held to its format's own
    resolution (``tolerance.rounding``), mapped onto ``TOL[torch.float64]``."""
    from ringify.testing.tolerance import relative_difference, rounding

    if want.dtype == torch.float64:
        return (got - want).abs().item()
    return relative_difference(got, want) * TOL[torch.float64] / rounding(want.dtype)


def run_compare(ranks, world, *args):
    if world == 1:
        return [compare(*args)]
    return ranks(world).run(compare, *args)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("name", ["nanogpt", "encoder", "gpt2", "llama"])
def test_matches_unmodified_model(ranks, world, name):
    results = run_compare(ranks, world, name, 8 * world, torch.float64, "zigzag")
    for r in results:
        assert r["gathers"] == []
        assert r["rewritten"] == 2
        # GPT-2 and Llama build their causal masks from positions: programs
        want = {
            "encoder": MaskKind.NONE,
            "gpt2": MaskKind.PROGRAM,
            "llama": MaskKind.PROGRAM,
        }.get(name, MaskKind.CAUSAL)
        assert r["masks"] == [(want, None)] * 2, r["masks"]
        for kind in ("logits", "loss", "grads", "inputs"):
            assert r[kind] <= TOL[torch.float64], (kind, r)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["falcon-mqa", "falcon-new-decoder"])
def test_falcon_picks_heads_by_index_without_gathers(ranks, world, name):
    """Falcon's fused_qkv[..., [-2], :] (aten.index on the head dim) keeps the sequence."""
    for r in run_compare(ranks, world, name, 8 * world, torch.float64, "zigzag"):
        assert r["gathers"] == [] and r["rewritten"] == 2, r["gathers"]
        for kind in ("logits", "loss", "grads"):
            assert r[kind] <= TOL[torch.float64], (kind, r)


@pytest.mark.parametrize("world", [2, 4])
def test_key_padding_mask_of_multihead_attention(ranks, world):
    """nn.TransformerEncoder with src_key_padding_mask: SDPA gets a mask with one query row
    (a broadcast, O(S)): the program is that mask, read per key tile."""
    for r in run_compare(ranks, world, "encoder-padding", 8 * world, torch.float64, "zigzag"):
        assert r["gathers"] == [] and r["rewritten"] == 2
        assert [m for m, _ in r["masks"]] == [MaskKind.PROGRAM] * 2, r["masks"]
        for kind in ("logits", "grads", "inputs"):
            assert r[kind] <= TOL[torch.float64], (kind, r)


@pytest.mark.parametrize("world", [2, 4])
def test_padding_mask_is_a_program(ranks, world):
    """HF GPT-2 with an attention_mask: the padding mask is an O(S) input of the mask's
    program, evaluated tile by tile, never an S x S tensor."""
    for r in run_compare(ranks, world, "gpt2-padding", 8 * world, torch.float64, "zigzag"):
        assert r["gathers"] == [] and r["rewritten"] == 2
        assert r["masks"] == [(MaskKind.PROGRAM, None)] * 2, r["masks"]
        for kind in ("logits", "loss", "grads"):
            assert r[kind] <= TOL[torch.float64], (kind, r)


COMPILED = ["nanogpt", "gpt2", "falcon-mqa", "cumsum", "pool", "softmax", "argmax", "take"]


@pytest.mark.parametrize(
    ("backend", "name"),
    [("aot_eager", n) for n in [*COMPILED, "biased", "t5-encoder"]]
    # under Inductor (the slow pass), each kind of op once: the others share their ops
    + [("inductor", n) for n in ("gpt2", "cumsum", "t5-encoder")]
    # the default pass keeps the ring's Inductor case
    + [pytest.param("inductor", "nanogpt-default", marks=pytest.mark.inductor_default)],
)
def test_compiled_matches_unmodified_model(ranks, backend, name):
    """torch.compile(ringified, fullgraph=True): no graph break, same results as eager;
    under Inductor within 1.5x of the unmodified model's own move under it."""
    name = name.removesuffix("-default")
    for r in run_compare(ranks, 2, name, 16, torch.float64, "zigzag", backend):
        for kind in ("logits", "loss", "grads"):
            assert r[kind] <= r["tolerances"][kind], (kind, r)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["biased", "t5-encoder", "t5"])
def test_learned_attention_bias_gets_exact_gradients_from_the_ring(ranks, world, name):
    """A float mask computed from parameters stays a ring and gets its exact gradient (never
    a zero one). T5's relative-position bias (a bucket embedding looked up at a function of
    key - query) is a mask program with a learned table: no S x S node, the table's
    gradient summed block by block. A (heads, S, S) bias parameter is kept, its gradient
    returned tile by tile. T5 seq2seq: the decoder's input is born inside the model by
    shifting the labels, so all of its 6 attentions are rings too."""
    for seq in (8 * world, 8 * world + 3):  # and a padded length
        for r in run_compare(ranks, world, name, seq, torch.float64, "zigzag"):
            assert r["gathers"] == []
            assert r["rewritten"] == {"biased": 1, "t5-encoder": 2, "t5": 6}[name]
            kinds = {kind for kind, _ in r["masks"]}
            assert kinds == ({MaskKind.KEPT} if name == "biased" else {MaskKind.PROGRAM}), r
            if name != "biased" and seq % 8:  # (a length no weight has)
                assert r["quadratic"] == [], r["quadratic"]
            for kind in ("logits", "loss", "grads", "inputs"):
                assert r[kind] <= TOL[torch.float64], (kind, r)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["t5-encoder", "t5"])
def test_a_bias_per_head_on_the_all_to_all(ranks, world, name):
    """``strategy="ulysses"``: T5's learned bias (a table of buckets by heads) differs per head;
    each rank evaluates its share of the heads' bias, and the table's gradient comes back from
    every rank's share. Every attention on the all-to-all, exact, at a padded length too."""
    for seq in (8 * world, 8 * world + 3):
        args = (name, seq, torch.float64, "zigzag", None, "ulysses")
        for r in ranks(world).run(compare, *args):
            assert r["gathers"] == [], r["gathers"]
            assert r["runs"] == [AttentionRun.ALL_TO_ALL] * r["rewritten"], r["runs"]
            assert {kind for kind, _ in r["masks"]} == {MaskKind.PROGRAM}, r["masks"]
            for kind in ("logits", "loss", "grads", "inputs"):
                assert r[kind] <= TOL[torch.float64], (kind, r)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_cumsum_along_the_sequence_is_a_ring_scan(ranks, world, layout):
    """A running sum over the sequence: each rank adds the totals of every earlier chunk."""
    for seq in (8 * world, 8 * world + 3):  # and a padded length
        for r in run_compare(ranks, world, "cumsum", seq, torch.float64, layout):
            assert r["gathers"] == [], r["gathers"]
            for kind in ("logits", "grads", "inputs"):
                assert r[kind] <= TOL[torch.float64], (kind, r)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("name", ["pool", "softmax", "argmax", "take"])
def test_pooling_over_the_sequence_reduces_over_the_ring(ranks, world, layout, name):
    """amax / amin / max, softmax and log_softmax over the sequence: the ring's maximum and
    sum, padding masked out; picked positions (cls, last token) taken from their ranks."""
    for seq in (8 * world, 8 * world + 3):
        for r in run_compare(ranks, world, name, seq, torch.float64, layout):
            assert r["gathers"] == [], r["gathers"]
            for kind in ("logits", "grads", "inputs"):
                assert r[kind] <= TOL[torch.float64], (kind, r)


@pytest.mark.parametrize("world", [2, 4])
def test_unsupported_op_runs_on_a_share_of_the_channels(ranks, world):
    """cummax over the sequence has no rule. It keeps its 16 channels independent, but the
    output projection after it needs them whole: the region is cut before it, its value going
    back to the sequence on the dim the graph gives it (never one read off a size: on 2 ranks
    the 16 positions are as many as the channels), and cummax runs on a share of the
    channels."""
    for r in run_compare(ranks, world, "cummax", 8 * world, torch.float64, "contiguous"):
        assert r["gathers"] == [] and r["resharded"] == [((("reshape", 2),), ())], r
        for kind in ("logits", "grads", "inputs"):
            assert r[kind] <= TOL[torch.float64], (kind, r)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("name", ["nanogpt", "encoder"])
def test_length_not_a_multiple_of_the_ring(ranks, world, layout, name):
    """Padded to the ring, the padding masked out: causal (nanogpt) and not (encoder)."""
    seq = 8 * world + 3
    for r in run_compare(ranks, world, name, seq, torch.float64, layout):
        assert r["gathers"] == []
        for kind in ("logits", "loss", "grads", "inputs"):
            assert r[kind] <= TOL[torch.float64], (kind, r)


def float32_against_reordering(name: str, seq: int):
    """On every rank: the float32 results (logits, loss, every gradient) that differ from
    the unmodified model's beyond the unmodified model's own difference with its batch rows
    swapped (``ringify.testing.tolerance``): float32 rounding depends on the CPU."""
    import torch.distributed as dist

    from ringify.testing.tolerance import differences, exceeding, reordering_tolerances

    model, g = _build(name, torch.float32, seq)
    args, kwargs = _inputs(name, seq, torch.float32, g)

    def results(run, args, kwargs, flipped=False):
        logits, loss, grads, _ = _forward_backward(run, model, args, kwargs)
        return {"logits": logits.flip(0) if flipped else logits, "loss": loss, **grads}

    want = results(model, args, kwargs)
    swapped_args = tuple(a.flip(0) for a in args)
    swapped_kwargs = {k: v.flip(0) for k, v in kwargs.items()}
    reordered = results(model, swapped_args, swapped_kwargs, flipped=True)
    got = results(ringify(model, ring_size=dist.get_world_size()), args, kwargs)
    return exceeding(differences(got, want), reordering_tolerances(want, reordered))


def test_float32(ranks):
    for wrong in ranks(2).run(float32_against_reordering, "gpt2", 16):
        assert wrong == {}, wrong


def compare_sharded(name, seq, layout, mask="sharded", compile_backend=None):
    """inputs/outputs="sharded": each rank passes its part of the ids and labels and gets
    its part of the logits; the loss and gradients are still the full model's. A padding
    ``attention_mask`` is passed sharded too, or full (``mask="full"``)."""
    import torch.distributed as dist

    from ringify.runtime import shard

    model, g = _build(name, torch.float64)
    args, kwargs = _inputs(name, seq, torch.float64, g)
    want = _forward_backward(model, model, args, kwargs, through_logits=False)
    ringified = ringify(
        model, ring_size=dist.get_world_size(), layout=layout, inputs="sharded", outputs="sharded"
    )
    args = tuple(shard(a, 1, layout=layout) for a in args)
    kwargs = {
        k: v if (k, mask) == ("attention_mask", "full") else shard(v, 1, layout=layout)
        for k, v in kwargs.items()
    }
    run = ringified
    if compile_backend:
        torch._dynamo.reset()
        run = torch.compile(ringified, backend=compile_backend, fullgraph=True)
    got = _forward_backward(run, model, args, kwargs, through_logits=False)
    return {
        "logits": (got[0] - shard(want[0], 1, layout=layout)).abs().max().item(),
        "loss": _loss_difference(got[1], want[1]),
        "grads": max((got[2][n] - want[2][n]).abs().max().item() for n in want[2]),
        "gathers": [(x.op, x.reason) for x in ringified.report().gathers],
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["nanogpt", "gpt2"])
def test_sharded_inputs_and_outputs(ranks, world, name):
    # HF shifts the labels inside the model (a pad and a slice along the sequence): with
    # sharded labels each rank takes its neighbour's first position (a halo, not a gather).
    for r in ranks(world).run(compare_sharded, name, 8 * world, "zigzag"):
        assert r["gathers"] == []
        for kind in ("logits", "loss", "grads"):
            assert r[kind] <= TOL[torch.float64], (kind, r)


@pytest.mark.parametrize(
    ("world", "mask", "backend"),
    [
        (2, "full", None),
        (4, "full", None),
        (2, "sharded", None),
        (4, "sharded", None),
        (2, "full", "aot_eager"),
        (2, "sharded", "aot_eager"),
    ],
)
def test_sharded_inputs_with_a_padding_mask(ranks, world, mask, backend):
    """A (B, S) padding mask beside sharded ids, passed full or as this rank's part (then
    gathered on entry: O(S), never the (S, S) mask it builds); eager and compiled."""
    args = ("gpt2-padding", 8 * world, "zigzag", mask, backend)
    for r in ranks(world).run(compare_sharded, *args):
        assert r["gathers"] == []
        for kind in ("logits", "loss", "grads"):
            assert r[kind] <= TOL[torch.float64], (kind, r)


class _KeysByRows(torch.nn.Module):
    """Attention whose padding mask comes as (sequence, batch): ``keep.T`` masks the keys."""

    def __init__(self):
        super().__init__()
        self.embed, self.qkv = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 48)

    def forward(self, ids, keep):
        q, k, v = self.qkv(self.embed(ids)).view(*ids.shape, 3, 2, 8).unbind(2)
        mask = keep.T[:, None, None, :]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum(1)


def sharded_keys_by_rows() -> float:
    """The worst difference from the unmodified model, output and gradients, with the ids
    and the (S, B) mask passed as this rank's part, the batch as long as a part."""
    import torch.distributed as dist

    from ringify.runtime import shard

    torch.manual_seed(0)
    model = _KeysByRows().double()
    ids = torch.randint(0, 64, (4, 8))
    keep = torch.rand(8, 4, generator=torch.Generator().manual_seed(1)) > 0.3
    keep[0] = True  # every row keeps a key
    want = model(ids, keep)
    want.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ringified = ringify(model, ring_size=dist.get_world_size(), inputs="sharded", outputs="sharded")
    got = ringified(shard(ids, 1), shard(keep, 0))
    got.square().sum().backward()
    worst = (got - shard(want, 1)).abs().max().item()
    return max(
        worst, *((p.grad - grads[n]).abs().max().item() for n, p in model.named_parameters())
    )


def test_a_sharded_mask_is_read_along_the_dim_that_reaches_the_keys(ranks):
    """A padding mask passed as (S / P, B) with B = S / P: its sequence dim is the one whose
    positions reach the mask's keys, never a dim picked by its size."""
    for worst in ranks(2).run(sharded_keys_by_rows):
        assert worst <= TOL[torch.float64]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    ("name", "mask"),
    [("llama-shift", "sharded"), ("llama-left-padding", "full"), ("llama-left-padding", "sharded")],
)
def test_sharded_inputs_for_hf_llama(ranks, world, name, mask):
    """HF Llama given each rank's zigzag part of its ids, labels and ``shift_labels`` (which
    the loss reads instead of the labels, then unread), or of its ids and labels beside a
    left-padding mask, passed full or as this rank's part: exact, nothing gathered."""
    for r in ranks(world).run(compare_sharded, name, 8 * world, "zigzag", mask):
        assert r["gathers"] == []
        for kind in ("logits", "loss", "grads"):
            assert r[kind] <= TOL[torch.float64], (kind, r)


class _TwoOutputs(torch.nn.Module):
    """An output and a second one the loss leaves out, computed by a layer of its own (LLaVA's
    vision tower returns its last layer, whose parameters its loss never reaches)."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        y = torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)
        return self.used(y), self.unused(y)


def unused_output_grads(backend):
    import torch.distributed as dist

    torch.manual_seed(0)
    model = _TwoOutputs().double()
    x = torch.randn(2, 2, 8 * dist.get_world_size(), 8, dtype=torch.float64)
    found = {}
    for name, fn in (("unmodified", model), ("ringified", ringify(model, ring_size=2))):
        run = torch.compile(fn, backend=backend) if backend else fn
        run(x)[0].sum().backward()
        found[name] = {n: p.grad for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
    return found


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_a_layer_only_an_unused_output_reaches_gets_what_the_unmodified_model_gives(ranks, backend):
    """Eager: no gradient (None). Compiled: what torch.compile gives the unmodified model,
    zeros (AOTAutograd fills the missing gradient of an unused output with zeros)."""
    for found in ranks(2).run(unused_output_grads, backend):
        want, got = found["unmodified"], found["ringified"]
        for name in ("unused.weight", "unused.bias"):
            assert (got[name] is None) == (want[name] is None), name
            assert got[name] is None or torch.equal(got[name], want[name]), name
        assert backend is not None or want["unused.weight"] is None


class _PickedTokens(torch.nn.Module):
    """Attention over the tokens and those a mask picks again (Mochi joins the valid text
    tokens, picked by ``nonzero``, to the image's): a length the data decides."""

    def forward(self, x, keep):
        joint = torch.cat([x, x[:, :, keep[0].nonzero().flatten()]], 2)
        return torch.nn.functional.scaled_dot_product_attention(joint, joint, joint)


def refused_picked_tokens() -> str:
    import torch.distributed as dist

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 8 * dist.get_world_size(), 4, generator=g, dtype=torch.float64)
    keep = torch.ones(1, x.shape[2], dtype=torch.bool)
    try:
        ringify(_PickedTokens(), ring_size=dist.get_world_size())(x, keep)
    except ValueError as e:
        return str(e)
    return ""


def test_a_sequence_whose_length_the_data_decides_is_refused_on_every_rank(ranks):
    for message in ranks(2).run(refused_picked_tokens):
        assert "depends on the data" in message and "Pad to a fixed length" in message, message


class _ViewAfterGather(torch.nn.Module):
    """k through an op with no rule, so the attention runs gathered, then the usual
    ``transpose(1, 2).view(B, S, H * D)``: traced on q's layout, (B, S, H, D) in memory, which
    the CPU kernel's output keeps; the gathered q must be laid out so too."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.qkv = heads, torch.nn.Linear(dim, 3 * dim)

    def forward(self, x):
        b, s, c = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(c, -1))
        k = torch.cummax(k, dim=2)[0]  # no rule: k replicated, so the attention is gathered
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return y.transpose(1, 2).view(b, s, c)


def view_after_gather() -> float:
    import torch.distributed as dist

    torch.manual_seed(0)
    model = _ViewAfterGather().double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8 * dist.get_world_size(), 16, generator=g, dtype=torch.float64)
    return (ringify(model, ring_size=dist.get_world_size())(x) - model(x)).abs().max().item()


def test_a_view_of_a_gathered_tensor_sees_its_traced_layout(ranks):
    for difference in ranks(2).run(view_after_gather):
        assert difference < TOL[torch.float64], difference
