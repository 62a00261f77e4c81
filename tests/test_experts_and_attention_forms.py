"""The model families of 2026 on the ring, against the unmodified model in float64: mixture-of-
experts LMs (Qwen3-MoE and Mixtral with their load-balancing loss, DeepSeek-V3 with MLA and
group-limited routing, gpt-oss with attention sinks, Llama 4's text model with every token
repeated once per expert and chunked attention), Gemma 2's soft-capped scores and BLOOM's
ALiBi through ``baddbmm`` (both eager: HF gives them no SDPA path).

Logits, loss, the router's aux loss and every gradient, on 2 and 4 ranks, eager and compiled.
These models compute parts in float32 inside a float64 model (HF's loss; DeepSeek's router;
Gemma's and BLOOM's attention probabilities, which the ring computes in float64), so each
result is held to the larger of two measured differences of the unmodified model: with its
batch rows swapped, and from itself with its attention softmax kept in float64 (the ring's
arithmetic); the others agree to 1e-10 (``ringify.testing.tolerance``). Nothing is gathered,
and each rank's experts see 1/P of the tokens' rows."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.overrides import TorchFunctionMode

from ringify.passes.graph.vocabulary import GROUPED_MM
from ringify.testing.models import AttendedRouter
from ringify.testing.runs import inductor_control, ringified_run

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "gemma2", "bloom", "llama4")
MOE = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")


def _model(name: str, experts: str | None = None):
    """The family's small model in float64; ``experts``: its experts run by that HF
    implementation instead, in float32 (``grouped_mm`` takes no float64)."""
    from ringify.testing import hf_models, hf_moe

    torch.manual_seed(0)
    build = getattr(hf_moe, name, None) or getattr(hf_models, name)
    if experts is None:
        return build().double()
    model = build().float()
    model.set_experts_implementation(experts)
    return model


def _results(model, run, ids: torch.Tensor, flipped: bool = False) -> dict[str, torch.Tensor]:
    """Logits, loss, aux loss (where the model has one) and every gradient, by name."""
    model.zero_grad(set_to_none=True)
    out = run(input_ids=ids, labels=ids)
    out.loss.backward()
    results = {"logits": out.logits.flip(0) if flipped else out.logits, "loss": out.loss}
    if getattr(out, "aux_loss", None) is not None:
        results["aux_loss"] = out.aux_loss
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {k: v.detach().clone() for k, v in (results | grads).items()}


class _Float64Softmax(TorchFunctionMode):
    """A softmax asked for in float32 of a float64 tensor (HF's eager attention) kept in
    float64: the unmodified model with the ring's arithmetic, to measure its own rounding."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        softmax = func in (torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax)
        if softmax and args[0].dtype == torch.float64 and kwargs.get("dtype") == torch.float32:
            kwargs["dtype"] = None
        return func(*args, **kwargs)


def _tolerances(want: dict, reordered: dict, float64: dict) -> dict[str, float]:
    from ringify.testing.tolerance import FACTOR, relative_difference, reordering_tolerances

    reordering = reordering_tolerances(want, reordered)
    return {
        n: max(t, FACTOR * relative_difference(want[n], float64[n])) for n, t in reordering.items()
    }


def _expert_rows(gm: torch.fx.GraphModule) -> list[int]:
    """The rows (token copies) each batched or grouped expert product of a graph multiplies,
    or that it splits by the experts' counts to multiply one by one, from its nodes' values (on a rank, once the pass is done: its local shapes)."""

    rows = []
    for m in gm.modules():
        if isinstance(m, torch.fx.GraphModule):
            for n in m.graph.nodes:
                batched = n.target is torch.ops.aten.bmm.default and n.meta["val"].dim() == 3
                if batched or str(n.target) in GROUPED_MM:
                    rows.append(n.meta["val"].shape[0])
                split = n.target is torch.ops.aten.split_with_sizes.default
                if split and any(isinstance(s, torch.fx.Node) for s in n.args[1]):
                    size = n.args[0].meta["val"].shape[0]  # split by the experts' counts
                    rows += [size] if isinstance(size, int) else []  # (not a cat of pieces)
    return rows


def compare(
    name: str,
    backend: str | None = None,
    strategy: str = "auto",
    experts: str | None = None,
    length: int | None = None,
    training: bool = True,
):
    import torch.distributed as dist

    from ringify.testing.tolerance import differences, exceeding, inductor_bound

    world = dist.get_world_size()
    model = _model(name, experts).train(training)
    ids = torch.randint(
        1, 64, (2, length or 16 * world), generator=torch.Generator().manual_seed(1)
    )
    want = _results(model, model, ids)
    reordered = _results(model, model, ids.flip(0), flipped=True)
    float64 = want
    if name in ("gemma2", "bloom"):  # their eager softmax is float32
        with _Float64Softmax():
            float64 = _results(model, model, ids)
    ringified, run = ringified_run(model, backend, strategy=strategy)
    got = _results(model, run, ids)
    report = ringified.report()
    top_k = getattr(model.config, "num_experts_per_tok", 0)
    tolerances = _tolerances(want, reordered, float64)
    control = inductor_control(model, backend)  # Inductor's own move: the bound under it
    if control is not None:
        own = differences(_results(model, control, ids), want)
        tolerances = {n: max(t, inductor_bound(own[n])) for n, t in tolerances.items()}
    return {
        "wrong": exceeding(differences(got, want), tolerances),
        "same grads": set(got) == set(want),
        "gathers": [(g.op, g.reason.value) for g in report.gathers],
        "forms": sorted({a.form for a in report.attentions}),
        "runs": sorted({a.run.name for a in report.attentions}),
        "expert rows": _expert_rows(ringified._active.module),
        "token copies": ids.numel() * top_k,  # the rows of each expert product, unmodified
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", FAMILIES)
def test_the_family_matches_the_unmodified_model(ranks, world, name):
    for r in ranks(world).run(compare, name, timeout=600):
        assert r["wrong"] == {}, r["wrong"]
        assert r["same grads"], r
        assert r["gathers"] == [], r["gathers"]
        if name in MOE:  # every expert product sees this rank's tokens' copies only
            assert r["expert rows"], r
            assert set(r["expert rows"]) == {r["token copies"] // world}, r
        if name == "gpt_oss":
            assert r["forms"] == ["by hand, with sinks"], r["forms"]
        if name == "gemma2":
            assert r["forms"] == ["by hand, soft-capped"], r["forms"]


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", MOE)
def test_grouped_mm_experts(ranks, world, name):
    """HF's default experts implementation, ``grouped_mm`` (float32: it takes no float64):
    the routed slots sorted by expert, one grouped product per projection with each
    expert's count as offsets, the rows put back by the inverse permutation. Each rank
    sorts and runs its own slots (``passes/sharding/dispatch.py``): nothing gathered."""
    for r in ranks(world).run(compare, name, None, "auto", "grouped_mm", timeout=600):
        assert r["wrong"] == {}, r["wrong"]
        assert r["same grads"] and r["gathers"] == [], r
        assert r["expert rows"] and set(r["expert rows"]) == {r["token copies"] // world}, r


def test_grouped_mm_experts_on_a_padded_sequence(ranks):
    """29 tokens on 2 ranks, padded to 32: each rank sorts its slots, its padding's too (the
    offsets count them), and the padding's results are never read."""
    for r in ranks(2).run(compare, "qwen3_moe", None, "auto", "grouped_mm", 29, timeout=600):
        assert r["wrong"] == {} and r["same grads"] and r["gathers"] == [], r
        assert set(r["expert rows"]) == {2 * 16 * 2}, r  # batch x padded half x top-k


@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss", "gemma2"])
def test_mla_sinks_and_soft_caps_on_the_all_to_all(ranks, name):
    """``strategy="ulysses"`` (what "auto" may pick on GPUs): DeepSeek-V3's MLA (v's head
    dim narrower than q's and k's), gpt-oss's sinks (a logit per head, on each rank's share
    of the heads) and Gemma 2's soft caps, against the unmodified model."""
    for r in ranks(2).run(compare, name, None, "ulysses", timeout=600):
        assert r["wrong"] == {}, r["wrong"]
        assert r["same grads"] and r["gathers"] == [], r
        assert r["runs"] == ["ALL_TO_ALL"], r["runs"]


@pytest.mark.parametrize(
    ("name", "backend"),
    [(n, "aot_eager") for n in [*FAMILIES, "jetmoe"]]
    # under Inductor (the slow pass): routers by topk, grouped GEMMs, MLA, sinks
    + [(n, "inductor") for n in ("jetmoe", "qwen3_moe", "deepseek_v3", "gpt_oss")],
)
def test_the_family_matches_the_unmodified_model_compiled(ranks, name, backend):
    """Compiled, fullgraph; under Inductor within 1.5x of the unmodified model's own move
    under it (JetMoE: its router logits returned, their aux loss in the step)."""
    for r in ranks(2).run(compare, name, backend, timeout=900):
        assert r["wrong"] == {}, r["wrong"]
        assert r["gathers"] == [], r["gathers"]


@pytest.mark.slow  # breadth of the class (25 s each): the families above are the default's
@pytest.mark.parametrize("name", ["deepseek_v2", "olmoe"])
def test_more_of_the_class(ranks, name):
    """DeepSeek-V2 (MLA) and OLMoE: nothing gathered."""
    import transformers

    version = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    if name == "deepseek_v2" and version < (5, 23):
        pytest.skip(
            "before 5.23 DeepSeek-V2 rotates q and k in complex64: float32 products whose "
            "rounding depends on the operands' memory layout (a strided and a contiguous "
            "product differ by an ulp), which no reordering of the unmodified model measures"
        )
    for r in ranks(2).run(compare, name, timeout=600):
        assert r["wrong"] == {}, r["wrong"]
        assert r["same grads"], r
        assert r["gathers"] == [], r["gathers"]


@pytest.mark.parametrize(
    ("world", "length"), [(2, None), (2, 29), pytest.param(4, 37, marks=pytest.mark.slow)]
)
def test_experts_one_by_one_over_rows_split_by_counts(ranks, world, length):
    """JetMoE runs its experts as ScatterMoE does, in the MLP and in its mixture of attention
    heads: the routed slots sorted by expert, split by each expert's count
    (``counts.tolist()``), one product per expert, the pieces put back together, the rows
    added back at their tokens or slots. Each rank splits its own slots by its own counts
    (padding included on 29 and 37 tokens): exact, nothing gathered, each expert product
    sees this rank's token copies only."""
    tokens = length or 16 * world
    padded = -(-tokens // (2 * world)) * 2 * world  # the zigzag layout's 2P chunks
    for r in ranks(world).run(functools.partial(compare, "jetmoe", length=length), timeout=600):
        assert r["wrong"] == {} and r["same grads"], r
        assert r["gathers"] == [], r["gathers"]
        assert set(r["expert rows"]) == {r["token copies"] // tokens * padded // world}, r


class _ExpertsOneByOne(AttendedRouter):
    """Attention, then ScatterMoE-style experts written small: the slots sorted by expert,
    split by each expert's count (a ``histc`` of the ids, read with ``tolist``), one product
    per expert, the pieces put together (``order``: in expert order, reversed, or in order
    by two ``cat``s in a ``cat``; "halves swapped": in order, each row's halves swapped by a
    split along the features first), and added back at their tokens."""

    def __init__(self, order: str):
        super().__init__()
        self.order = order

    def forward(self, x):
        b, s, _ = x.shape
        y = self.attended(x).reshape(b * s, 8)
        gates, ids = self.router(y).softmax(-1).topk(2, dim=-1)
        perm = ids.flatten().argsort()
        rows = y[perm // 2]
        if self.order == "halves swapped":  # a split of the rows that is not by the counts
            rows = torch.cat(rows.split([4, 4], dim=1)[::-1], dim=1)
        counts = torch.histc(ids.flatten().double(), bins=4, min=0, max=3)
        pieces = rows.split(counts.long().tolist())
        outs = [piece @ self.experts[e] for e, piece in enumerate(pieces)]
        if self.order == "nested":
            out = torch.cat([torch.cat(outs[:2]), torch.cat(outs[2:])])
        else:
            out = torch.cat(outs[::-1] if self.order == "reversed" else outs)
        out = out * gates.flatten()[perm, None]
        return torch.zeros_like(y).index_add(0, perm // 2, out).view(b, s, 8)


def experts_one_by_one(order: str) -> dict:
    from ringify import ringify

    torch.manual_seed(0)
    model = _ExpertsOneByOne(order).double()
    x = torch.randn(2, 12, 8, dtype=torch.float64)

    def run(fn):
        model.zero_grad(set_to_none=True)
        out = fn(x)
        out.sum().backward()
        return [out.detach(), *(p.grad for p in model.parameters())]

    ringified = ringify(model, ring_size=2)
    want, got = run(model), run(ringified)
    return {
        "worst": max((g - w).abs().max().item() for g, w in zip(got, want, strict=True)),
        "gathers": {g.op for g in ringified.report().gathers},
    }


@pytest.mark.parametrize("order", ["in order", "halves swapped", "reversed", "nested"])
def test_pieces_put_together_out_of_order_are_gathered(ranks, order):
    """The region holds only where the pieces come back in expert order: the rows are then
    in the sort's order again. Out of order (a model's choice, whatever it means), or by a
    form the region does not read (a ``cat`` of ``cat``s), the sort is gathered and the
    result is still the unmodified model's."""
    for r in ranks(2).run(experts_one_by_one, order, timeout=600):
        assert r["worst"] < 1e-12, r
        gathered = order not in ("in order", "halves swapped")
        assert ("aten.argsort.default" in r["gathers"]) == gathered, r


def sampled_routing() -> str | None:
    """PhiMoE in training: ringify's error, where it raises one."""
    _, run = ringified_run(_model("phimoe"), None)
    try:
        run(input_ids=torch.randint(1, 64, (2, 32), generator=torch.Generator().manual_seed(1)))
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("world", [2, 4])
def test_a_sampling_router(ranks, world):
    """PhiMoE's sparse mixer. In eval mode its best experts are a ``max`` over the experts
    inside ``torch.no_grad()`` (a region export wraps, inlined): exact, nothing gathered.
    In training it samples them (Gumbel noise: ``exponential_``, drawn whole on every rank
    as the model draws it, this rank's share kept) and scales their gradients by a custom
    autograd Function, whose backward torch.export does not keep: every rank refuses it,
    naming it."""
    in_eval_mode = functools.partial(compare, training=False)
    for r in ranks(world).run(in_eval_mode, "phimoe", timeout=600):
        assert r["wrong"] == {} and r["same grads"], r
        assert r["gathers"] == [], r["gathers"]
    for error in ranks(world).run(sampled_routing, timeout=600):
        assert error is not None and "PhimoeMultiplier" in error, error
