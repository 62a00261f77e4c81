"""Training on batches of varying length: one graph for every length (``ringify/tracing/lengths.py``).

HF Llama trained for 30 steps of random lengths (odd ones among them, which the ring pads),
against the unmodified model, float64, on 2 and 4 gloo ranks: every step's logits and every
parameter gradient within 1e-10, HF's loss (computed in float32) within 4x float32's own
rounding of it (measured each step against the loss in float64), with at most 2 traces (the first length's, then one graph
for all lengths), and under aot_eager and inductor at most 2 Dynamo graphs (the first
length's, then one with a dynamic length). Models whose graph depends on the length in a way
the lifted graph cannot carry (a float of the length, a fixed-size slice) are traced per
length, exact, and the report says why.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ringify.testing.hf_models import llama
from ringify.testing.runs import ringified_run

TOL = 1e-10


def train(steps: int, backend: str | None, low: int = 10, high: int = 80):
    """Per step, ringify (through ``backend``) against the unmodified model; with a backend,
    also the unmodified model through it against itself eager: HF Llama computes RoPE in
    float32, which Inductor fuses and rounds otherwise, so that difference is the bound."""
    torch.manual_seed(0)
    model = llama(layers=2).double()
    reference = llama(layers=2).double()
    reference.load_state_dict(model.state_dict())
    ringified, run = ringified_run(model)
    graphs = []  # what Dynamo compiles of the ringified model
    if backend:
        run = torch.compile(ringified, backend=_counted(backend, graphs), fullgraph=True)
    compiled = torch.compile(reference, backend=backend) if backend else None
    g = torch.Generator().manual_seed(3)
    weights = torch.randn(2, high, 64, generator=g, dtype=torch.float64)
    errors = dict.fromkeys(["logits", "grads", "own logits", "own grads", "loss", "own loss"], 0.0)
    lengths = set()

    def step(fn, m, ids):
        m.zero_grad(set_to_none=True)
        out = fn(input_ids=ids, labels=ids)
        (out.logits * weights[:, : ids.shape[1]]).sum().backward()  # float64 gradients
        losses.append(out.loss.detach())  # HF's loss: computed in float32
        return out.logits.detach(), [p.grad for p in m.parameters()]

    def note(prefix, a, b):
        errors[prefix + "logits"] = max(errors[prefix + "logits"], (a[0] - b[0]).abs().max().item())
        grads = max((x - y).abs().max().item() for x, y in zip(a[1], b[1], strict=True))
        errors[prefix + "grads"] = max(errors[prefix + "grads"], grads)

    for _ in range(steps):
        length = int(torch.randint(low, high, (1,), generator=g))
        lengths.add(length)
        ids = torch.randint(0, 64, (2, length), generator=g)
        losses = []
        got, want = step(run, model, ids), step(reference, reference, ids)
        note("", got, want)
        # the loss in float64 from the unmodified logits: float32's own rounding, the bound
        exact = torch.nn.functional.cross_entropy(
            want[0][:, :-1].flatten(0, 1), ids[:, 1:].flatten()
        )
        errors["loss"] = max(errors["loss"], abs(losses[0].item() - losses[1].item()))
        errors["own loss"] = max(errors["own loss"], abs(losses[1].item() - exact.item()))
        if compiled is not None:
            losses = []
            note("own ", step(compiled, reference, ids), want)
    return errors | {
        "lengths": len(lengths),
        "traces": ringified.traces,
        "graphs": len(graphs),
        "report": ringified.report().lengths,
    }


def _counted(backend: str, graphs: list):
    """``backend``, noting each graph Dynamo hands it."""

    def compile_graph(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    return compile_graph


# 4 ranks: a long sweep the slow pass runs (2 ranks cover the default suite)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_thirty_random_lengths_trace_twice(ranks, world):
    for r in ranks(world).run(train, 30, None, timeout=600):
        assert r["lengths"] > 20, r
        assert r["logits"] < TOL and r["grads"] < TOL, r
        assert r["loss"] <= 4 * r["own loss"], r
        assert r["traces"] <= 2, r
        assert r["report"].startswith("any length"), r


@pytest.mark.slow  # thirty lengths compiled: a long sweep (the eager sweep is in the default suite)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_random_lengths_compile_twice(ranks, backend):
    for r in ranks(2).run(train, 30, backend, timeout=900):
        assert r["lengths"] > 20, r
        for what in ("logits", "grads"):
            assert r[what] <= max(TOL, 4 * r["own " + what]), r
        assert r["traces"] <= 2, r
        assert 1 <= r["graphs"] <= 2, r


class _LengthInside(nn.Module):
    """Attention whose model also reads its length as a number (``how``): a scale of one over
    the length, or a fixed-size slice of the sequence."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.proj = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.proj(x).view(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).reshape(x.shape)
        if self.how == "scale":
            return out * (1.0 / x.shape[1])
        return out[:, :12]


def length_inside(how: str, backend: str | None = None, lengths=(14, 19, 23)):
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch.manual_seed(0)
    model = _LengthInside(how).double()
    ringified, run = ringified_run(model, backend)

    def users_own(x):  # the user's other compiled code, compiled before the lengths run
        return x.sin() + 1

    torch.compile(users_own, backend="eager", fullgraph=True)(torch.ones(3))
    worst = 0.0
    for length in lengths:
        x = torch.randn(
            2, length, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(length)
        )
        worst = max(worst, (run(x) - model(x)).abs().max().item())
    return {
        "error": worst,
        "traces": ringified.traces,
        "report": ringified.report().lengths,
        "users_entries": len(_debug_get_cache_entry_list(users_own.__code__)),
    }


@pytest.mark.parametrize("how", ["scale", "slice"])
def test_a_length_read_as_a_number_is_traced_per_length(ranks, how):
    for r in ranks(2).run(length_inside, how):
        assert r["error"] < TOL, r
        assert r["traces"] == 3, r
        assert r["report"].startswith("per length: "), r


def test_a_length_traced_anew_never_crashes_a_compiled_model(ranks):
    """Twelve lengths of a model traced per length, under torch.compile with
    ``fullgraph=True``: twelve graphs, more than Dynamo's recompile limit (8) of one frame.
    Each graph is a frame of its own, so none is refused, every result is exact, and the
    user's other compiled function keeps its cache entry (nothing resets torch.compile)."""
    lengths = tuple(range(14, 26))
    for r in ranks(2).run(length_inside, "scale", "aot_eager", lengths, timeout=600):
        assert r["error"] < TOL, r
        assert r["traces"] == len(lengths), r
        assert r["users_entries"] == 1, r


def sharded_outputs():
    from ringify.runtime import gather

    torch.manual_seed(0)
    model = llama(layers=2).double().eval()
    ringified, run = ringified_run(model, outputs="sharded")
    worst, refused = 0.0, ""
    for length in (16, 24, 18, 40, 48):  # 18: not a multiple of 4, which the ring needs here
        ids = torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(length))
        try:
            local = run(input_ids=ids).logits
        except ValueError as e:
            refused = str(e)
            continue
        got = gather(local.contiguous(), 1, layout="zigzag")
        worst = max(worst, (got - model(input_ids=ids).logits).abs().max().item())
    return {"error": worst, "traces": ringified.traces, "refused": refused}


def test_sharded_outputs_share_one_graph_for_lengths_the_ring_splits(ranks):
    """``outputs="sharded"`` takes no padding: the lengths that split evenly share one graph
    (2 traces for 16, 24, 40, 48), and one that does not is refused as before."""
    for r in ranks(2).run(sharded_outputs):
        assert r["error"] < TOL, r
        assert r["traces"] == 2, r
        assert "does not split" in r["refused"], r


def checkpointed_lengths():
    """HF gradient checkpointing on the lifted graph: kept, and exact at every length."""
    torch.manual_seed(0)
    model = llama(layers=2).double()
    reference = llama(layers=2).double()
    reference.load_state_dict(model.state_dict())
    for m in (model, reference):
        m.gradient_checkpointing_enable({"use_reentrant": False})
    ringified, run = ringified_run(model)
    worst = 0.0
    for length in (21, 30, 37, 44):
        ids = torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(length))
        results = []
        for fn, m in ((run, model), (reference, reference)):
            m.zero_grad(set_to_none=True)
            logits = fn(input_ids=ids).logits
            logits.pow(2).sum().backward()
            results.append([logits.detach(), *(p.grad for p in m.parameters())])
        worst = max(worst, max((a - b).abs().max().item() for a, b in zip(*results, strict=True)))
    report = ringified.report()
    return {
        "error": worst,
        "traces": ringified.traces,
        "kept": report.checkpointed,
        "lengths": report.lengths,
    }


def test_checkpointed_layers_stay_checkpointed_at_every_length(ranks):
    for r in ranks(2).run(checkpointed_lengths):
        assert r["error"] < TOL, r
        assert r["traces"] == 2 and r["lengths"].startswith("any length"), r
        assert r["kept"] == ("model.layers.0", "model.layers.1"), r


def fsdp_lengths():
    """Per-layer FSDP2 on a (dp, cp) = (2, 2) mesh, three lengths: each dp replica's batch on
    its ring, against the unmodified model on the global batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ringify import ringify

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    torch.manual_seed(0)
    model = llama(layers=2).double()
    reference = llama(layers=2).double()
    reference.load_state_dict(model.state_dict())
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    ringified = fully_shard(ringify(model, ring_size=2, mesh=mesh["cp"]), mesh=mesh["dp"])
    worst = 0.0
    for length in (16, 21, 27):
        ids = torch.randint(1, 64, (4, length), generator=torch.Generator().manual_seed(length))
        mine = ids.split(2)[mesh["dp"].get_local_rank()]
        ringified(input_ids=mine, labels=mine).loss.backward()
        reference(input_ids=ids, labels=ids).loss.backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            worst = max(worst, (p.grad.full_tensor() - q.grad).abs().max().item())
        model.zero_grad()
        reference.zero_grad()
    report = ringified.report()
    return {
        "error": worst,
        "traces": ringified.traces,
        "units": report.fsdp_units,
        "lengths": report.lengths,
    }


def test_per_layer_fsdp2_shares_one_graph_for_every_length(ranks):
    for r in ranks(4).run(fsdp_lengths, timeout=600):
        assert r["error"] < TOL, r
        assert r["traces"] == 2 and r["lengths"].startswith("any length"), r
        assert r["units"] == ("model.layers.0", "model.layers.1"), r


def long_first_call() -> tuple[str, float]:
    from ringify.tracing.lengths import SMALL_FIRST

    torch.manual_seed(0)
    model = llama().double()
    model.config.max_position_embeddings = 2 * SMALL_FIRST
    ringified, run = ringified_run(model, None)
    ids = torch.randint(1, 64, (1, SMALL_FIRST + 3), generator=torch.Generator().manual_seed(0))
    worst = (run(input_ids=ids).logits - model(input_ids=ids).logits).abs().max()
    return ringified.report().lengths, float(worst)


def test_a_long_first_call_whose_export_holds_any_length_is_traced_at_its_own(ranks):
    """A long first call of a model whose symbolic export keeps the length (HF Llama: its
    export does not grow with the length) is traced once, at its length, not at four small
    ones (``lift_from_small``)."""
    for lengths, worst in ranks(2).run(long_first_call):
        assert lengths == "this length" and worst < TOL, (lengths, worst)


def counts_read_on_the_host() -> list:
    """JetMoE (its experts split by counts read with ``tolist()``: sizes the data decides)
    at 32, 48 and 29 tokens: each step's differences, and the traces."""
    from ringify.testing.hf_moe import jetmoe

    torch.manual_seed(0)
    model = jetmoe().double()
    model.config.output_router_logits = False  # its aux loss divides by a float of the length
    ringified, _ = ringified_run(model)
    worst = []
    for length in (32, 48, 29):
        ids = torch.randint(1, 64, (2, length), generator=torch.Generator().manual_seed(length))

        def step(fn, ids):
            model.zero_grad(set_to_none=True)
            logits = fn(input_ids=ids).logits
            (logits * torch.linspace(0, 1, logits.numel()).view_as(logits)).sum().backward()
            return [logits.detach(), *(p.grad.clone() for p in model.parameters())]

        diffs = zip(step(model, ids), step(ringified, ids), strict=True)
        worst.append(max((a - b).abs().max().item() for a, b in diffs))
    return [worst, ringified.traces, ringified.report().lengths]


def test_sizes_the_data_decides_share_one_graph_for_every_length(ranks):
    """A size read from the data (``u0``, an expert's count) is no size of the length: the
    graph still holds for every length, the counts read at run time. Exact, two traces."""
    for worst, traces, lengths in ranks(2).run(counts_read_on_the_host, timeout=600):
        assert max(worst) < TOL, worst
        assert traces == 2 and lengths.startswith("any length"), (traces, lengths)
