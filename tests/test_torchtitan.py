"""torchtitan's own models on the ring, called as torchtitan's trainer calls them: the masks
built outside the model (``model.get_attention_masks(positions)``, a FlexAttention
``BlockMask``) and passed in, float64, 2 layers, against the unmodified model (output and every
parameter gradient), 2 and 4 ranks, zero gathers.

CPU flex has no backward: torchtitan's compiled flex is run eagerly, the unmodified model's
gradients come from the same attention written densely (its ``mask_mod`` evaluated on the
whole grid), and the ringified model traces under ``no_grad`` first (its graph holds no flex
op, then trains). CI installs torchtitan for this module (``.ci/run``); without it, skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from ringify.passes.graph.report import AttentionRun

pytest.importorskip("torchtitan.models.llama3", reason="torchtitan 0.3 is not installed")

TOL = 1e-10
BATCH = 2


@contextlib.contextmanager
def _flex(attend):
    """torchtitan's compiled flex_attention replaced by ``attend`` (undone after)."""
    from torchtitan.models.common.attention import FlexAttention

    saved = FlexAttention.__dict__["_compiled_flex_attn"]
    FlexAttention._compiled_flex_attn = staticmethod(attend)
    try:
        yield
    finally:
        FlexAttention._compiled_flex_attn = saved


def dense_flex(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
               return_aux=None, kernel_options=None):  # fmt: skip
    """flex_attention written densely: its mask_mod and score_mod on the whole grid."""
    from torch.nn.attention.flex_attention import AuxOutput

    if enable_gqa:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    b, h, i, j = (
        torch.arange(n).view([-1 if d == a else 1 for d in range(4)])
        for a, n in enumerate(scores.shape)
    )
    if score_mod is not None:
        scores = score_mod(scores, b, h, i, j)
    if block_mask is not None:
        scores = scores.masked_fill(~block_mask.mask_mod(b, h, i, j), float("-inf"))
    lse = scores.logsumexp(-1)
    out = torch.softmax(scores, -1) @ v
    return out, AuxOutput(lse=lse if return_aux is not None and return_aux.lse else None)


def llama3():
    from torchtitan.models.llama3 import llama3_configs

    return llama3_configs["debugmodel"](attn_backend="flex")


def qwen3():
    from torchtitan.models.qwen3 import qwen3_configs

    return qwen3_configs["debugmodel"](attn_backend="flex")


def gpt_oss():
    from torchtitan.models.gpt_oss import gptoss_configs

    return gptoss_configs["debugmodel"]("standard", attn_backend="flex")


def deepseek_v3():
    from torchtitan.models.deepseek_v3 import deepseekv3_configs

    return deepseekv3_configs["debugmodel"](attn_backend="flex", moe_comm_backend="standard")


FAMILIES = {"llama3": llama3, "qwen3": qwen3, "gpt_oss": gpt_oss, "deepseek_v3": deepseek_v3}


def _model(family: str):
    config = FAMILIES[family]()
    config = dataclasses.replace(config, layers=config.layers[:2])
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    return model.double()


def _inputs(model, seq: int, documents: bool, shift: int = 0):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.config.vocab_size, (BATCH, seq), generator=g)
    if documents:  # three packed documents per row, at different places in each row
        cuts = [(0, seq // 3 + shift, seq - 5), (0, 7, seq // 2 - shift)]
        positions = torch.stack(
            [
                torch.cat([torch.arange(b - a) for a, b in zip(c, (*c[1:], seq), strict=True)])
                for c in cuts
            ]
        )
    else:
        positions = torch.arange(seq).expand(BATCH, seq)
    return tokens, positions


def _step(model, run, tokens, positions, rows: slice = slice(None)):
    """Output and every parameter gradient of one step (the masks built outside the model);
    ``rows``: of the batch's rows these alone, weighted as in the whole batch's step."""
    model.zero_grad(set_to_none=True)
    tokens, positions = tokens[rows], positions[rows]
    out = run(tokens, positions=positions, attention_masks=model.get_attention_masks(positions))
    shape = (BATCH, *out.shape[1:])
    weights = torch.randn(shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    (out * weights[rows]).sum().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}


def _row_by_row(model, tokens, positions) -> dict:
    """The parameter gradients of ``_step``, summed over its batch rows run one at a time."""
    steps = [_step(model, model, tokens, positions, slice(b, b + 1))[1] for b in range(BATCH)]
    return {n: sum(s[n] for s in steps) for n in steps[0]}


def _expert_rows(gm: torch.fx.GraphModule) -> list[int]:
    """The rows each grouped expert product of a ringified graph multiplies (its nodes'
    values on this rank, once the pass is done: local shapes)."""
    return [
        n.meta["val"].shape[0]
        for m in gm.modules()
        if isinstance(m, torch.fx.GraphModule)
        for n in m.graph.nodes
        if n.target is torch.ops.aten._grouped_mm.default
    ]


def compare(family: str, seq: int, documents: bool):
    import torch.distributed as dist
    from torch.nn.attention.flex_attention import flex_attention

    from ringify import ringify
    from ringify.testing.tolerance import differences, exceeding, reordering_tolerances

    model = _model(family)
    tokens, positions = _inputs(model, seq, documents)
    with _flex(dense_flex):
        want = _step(model, model, tokens, positions)
        # DeepSeek-V3's experts compute in bfloat16 whatever the model's dtype: each rank's
        # part of their weights' gradients is rounded to bfloat16 before the ring adds them.
        # The unmodified model's own such sum (one batch row at a time) measures it.
        tolerances = reordering_tolerances(want[1], _row_by_row(model, tokens, positions))
    with _flex(flex_attention):
        with torch.no_grad():  # the unmodified flex model, forward only
            flex_out = model(
                tokens, positions=positions, attention_masks=model.get_attention_masks(positions)
            )
        ringified = ringify(model, ring_size=dist.get_world_size())
        with torch.no_grad():
            first = ringified(
                tokens, positions=positions, attention_masks=model.get_attention_masks(positions)
            )
        got = _step(model, ringified, tokens, positions)
        # other documents, the same graph: the mask is read from this call's inputs
        tokens, positions = _inputs(model, seq, documents, shift=3)
        with torch.no_grad():
            masks = model.get_attention_masks(positions)
            again = ringified(tokens, positions=positions, attention_masks=masks)
            again_want = model(tokens, positions=positions, attention_masks=masks)
    report = ringified.report()
    return {
        "out": max(
            (got[0] - want[0]).abs().max().item(),
            (first - flex_out).abs().max().item(),
            (again - again_want).abs().max().item(),
        ),
        "dense vs flex": (want[0] - flex_out).abs().max().item(),
        "wrong grads": exceeding(differences(got[1], want[1]), tolerances),
        "rounded grads": {  # the bfloat16 ones: (difference, tolerance)
            n: (d, tolerances[n])
            for n, d in differences(got[1], want[1]).items()
            if tolerances[n] > TOL
        },
        "missing": [n for n, g in got[1].items() if g is None],
        "runs": {(a.run, a.form) for a in report.attentions},
        "gathers": [g.op for g in report.gathers],
        "traces": ringified.traces,
        "expert rows": _expert_rows(ringified._active.module),
        "routed slots": tokens.numel() * _top_k(model),
    }


def _top_k(model) -> int:
    from torchtitan.models.common.moe import MoE

    return next((m.router.top_k for m in model.modules() if isinstance(m, MoE)), 0)


def _flux_inputs(side: int, text: int = 8) -> dict:
    """Flux's inputs: a ``side`` x ``side`` grid of latent patches and ``text`` tokens."""
    g = torch.Generator().manual_seed(0)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(1, -1, 3).double()
    return {
        "img": torch.randn(BATCH, side * side, 64, generator=g, dtype=torch.float64),
        "img_ids": ids.expand(BATCH, -1, 3),
        "txt": torch.randn(BATCH, text, 4096, generator=g, dtype=torch.float64),
        "txt_ids": torch.zeros(BATCH, text, 3, dtype=torch.float64),
        "timesteps": torch.rand(BATCH, generator=g, dtype=torch.float64),
        "y": torch.randn(BATCH, 768, generator=g, dtype=torch.float64),
    }


def _flux_model():
    """torchtitan's ``flux-debug``, one double and one single block. torchtitan's Flux package
    imports its data loader, which imports ``datasets``: that import is stood in for here (no
    data set is loaded)."""
    import sys
    import types

    added = [name for name in ("datasets", "datasets.distributed") if name not in sys.modules]
    for name in added:
        stand_in = types.ModuleType(name)
        stand_in.Dataset = stand_in.load_dataset = stand_in.split_dataset_by_node = None
        sys.modules[name] = stand_in
    try:
        from torchtitan.models.flux import flux_configs
    finally:  # gone again: other code asks whether datasets is installed
        for name in added:
            del sys.modules[name]

    config = flux_configs["flux-debug"]()
    config = dataclasses.replace(
        config, double_blocks=config.double_blocks[:1], single_blocks=config.single_blocks[:1]
    )
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    return model.double()


def compare_flux(side: int):
    import torch.distributed as dist

    from ringify import ringify

    model, kwargs = _flux_model(), _flux_inputs(side)

    def step(run):
        model.zero_grad(set_to_none=True)
        out = run(**kwargs)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).double()
        (out * weights).sum().backward()
        return out.detach(), {n: p.grad for n, p in model.named_parameters()}

    want = step(model)
    ringified = ringify(model, ring_size=dist.get_world_size())
    got = step(ringified)
    report = ringified.report()
    return {
        "out": (got[0] - want[0]).abs().max().item(),
        "grads": max((got[1][n] - want[1][n]).abs().max().item() for n in want[1]),
        "missing": [n for n, g in got[1].items() if g is None],
        "runs": [a.run for a in report.attentions],
        "gathers": [g.op for g in report.gathers],
    }


FOUR = pytest.param(4, marks=pytest.mark.slow)  # 4 ranks on 2 cores: in CI's slow pass


@pytest.mark.parametrize("world", [2, FOUR])
def test_flux(ranks, world):
    """Flux's joint attention (text and image tokens in one sequence, a fused qkv unpacked by
    ``unbind`` with its default dim): the image tokens stay sharded, the text replicated."""
    # 8 x 8 patches: each chunk of the layout is whole rows
    for r in ranks(world).run(compare_flux, 8, timeout=300):
        assert r["out"] < TOL and r["grads"] < TOL and r["missing"] == [], r
        assert r["gathers"] == [], r
        assert AttentionRun.GATHERED not in r["runs"], r


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("world", [2, FOUR])
@pytest.mark.parametrize("family", ["llama3", "qwen3", "deepseek_v3"])
def test_flex_with_the_mask_passed_in(ranks, family, world, documents):
    """DeepSeek-V3: MLA's attention on the ring, its first layer dense and its second MoE,
    whose token dispatch (torchtitan's LocalTokenDispatcher: the routed slots sorted by
    expert, grouped GEMMs, a scatter_add back) runs on each rank's own slots: each grouped
    product multiplies 1/P of the slots. Its experts' weight gradients round in bfloat16 by
    the slots' order: bounded by the unmodified model's own, its batch rows reversed."""
    for r in ranks(world).run(compare, family, 16 * world, documents, timeout=300):
        assert r["dense vs flex"] < TOL, r  # the reference is the model's own attention
        assert r["out"] < TOL and r["wrong grads"] == {} and r["missing"] == [], r
        assert r["runs"] == {(AttentionRun.RING, "flex_attention")}, r
        assert r["traces"] == 1 and r["gathers"] == [], r
        if family == "deepseek_v3":  # three grouped products (w1, w3, w2) in its MoE layer
            assert r["expert rows"] == [r["routed slots"] // world] * 3, r
            assert r["rounded grads"] and all("experts" in n for n in r["rounded grads"]), r
        else:
            assert r["expert rows"] == [] and not r["rounded grads"], r


def checkpoint_round_trip(folder: str):
    """torchtitan's CheckpointManager (DCP underneath) saves the ringified model and loads the
    checkpoint into the unmodified model, and the other way; then the ringified model, on the
    weights it loaded, computes what the model does."""
    import torch.distributed as dist
    from torchtitan.components.checkpoint import CheckpointManager

    from ringify import ringify

    def manager(model, name: str):
        config = CheckpointManager.Config(
            enable=True,
            folder=name,
            last_save_model_only=True,
            exclude_from_loading=["dataloader", "optimizer", "lr_scheduler"],
        )
        return CheckpointManager(
            config, dataloader=None, model_parts=[model], optimizers=None, lr_schedulers=None,
            states={}, sd_adapter=None, base_folder=folder,
        )  # fmt: skip

    def zeroed(model):
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        return model

    world = dist.get_world_size()
    model = _model("llama3")
    manager(ringify(model, ring_size=world), "from_ring").save(1, last_step=True)
    unmodified = zeroed(_model("llama3"))
    loaded_unmodified = manager(unmodified, "from_ring").load(1)
    manager(model, "to_ring").save(1, last_step=True)
    back = zeroed(_model("llama3"))
    ring = ringify(back, ring_size=world)
    loaded_ring = manager(ring, "to_ring").load(1)
    tokens, positions = _inputs(model, 16 * world, documents=True)
    from torch.nn.attention.flex_attention import flex_attention

    masks = model.get_attention_masks(positions)
    with _flex(flex_attention), torch.no_grad():
        want = model(tokens, positions=positions, attention_masks=masks)
        got = ring(tokens, positions=positions, attention_masks=masks)
    state = model.state_dict()
    return {
        "loaded": (loaded_unmodified, loaded_ring),
        "into the model": max((unmodified.state_dict()[k] - v).abs().max().item() for k, v in state.items()),
        "into the ring": max((back.state_dict()[k] - v).abs().max().item() for k, v in state.items()),
        "out": (got - want).abs().max().item(),
    }  # fmt: skip


def test_a_torchtitan_checkpoint_round_trips(ranks, tmp_path):
    for r in ranks(2).run(checkpoint_round_trip, str(tmp_path)):
        assert r["loaded"] == (True, True), r
        assert r["into the model"] == 0 and r["into the ring"] == 0, r
        assert r["out"] < TOL, r


class GptOssAttentions(torch.nn.Module):
    """torchtitan's gpt-oss with its experts left out (they compute in bfloat16 whatever the
    model's dtype, and fail in float64): each block's own attention (flex with the sinks
    applied to its output through the log-sum-exp; sliding windows of 128 on even layers),
    residual, under the mask the block picks from the model's masks."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, positions, attention_masks):
        h = self.model.tok_embeddings(tokens)
        for block in self.model.layers.values():
            mask = attention_masks[block.attn_mask_key]
            h = h + block.attention(block.attention_norm(h), mask, positions)
        return self.model.norm(h)


def compare_gpt_oss(seq: int):
    import torch.distributed as dist
    from torch.nn.attention.flex_attention import flex_attention

    from ringify import ringify

    model = _model("gpt_oss")
    with torch.no_grad():
        for block in model.layers.values():
            block.attention.sinks.normal_()  # sinks that matter
    attentions = GptOssAttentions(model)
    tokens, positions = _inputs(model, seq, documents=True)
    run = lambda m: lambda t, positions, attention_masks: m(t, positions, attention_masks)
    with _flex(dense_flex):
        want = _step(model, run(attentions), tokens, positions)
    ringified = ringify(attentions, ring_size=dist.get_world_size())
    with _flex(flex_attention):
        with torch.no_grad():
            ringified(tokens, positions, model.get_attention_masks(positions))
        got = _step(model, run(ringified), tokens, positions)
    report = ringified.report()
    grads = [n for n in want[1] if want[1][n] is not None]
    return {
        "out": (got[0] - want[0]).abs().max().item(),
        "grads": max((got[1][n] - want[1][n]).abs().max().item() for n in grads),
        "sinks": [n for n in grads if n.endswith("sinks")],
        "missing": [n for n in grads if got[1][n] is None],
        "runs": {(a.run, a.form) for a in report.attentions},
        "gathers": [g.op for g in report.gathers],
    }


@pytest.mark.parametrize("world", [2, FOUR])
def test_gpt_oss_sinks_with_the_mask_passed_in(ranks, world):
    """The log-sum-exp that rescales the output by the sinks is read as attention with sinks
    (the ring op's); 160 tokens, past the 128-token window."""
    for r in ranks(world).run(compare_gpt_oss, 160, timeout=300):
        assert r["out"] < TOL and r["grads"] < TOL and r["missing"] == [], r
        assert len(r["sinks"]) == 2, r  # both layers' sinks get their gradient
        assert r["runs"] == {(AttentionRun.RING, "flex_attention, with sinks")}, r
        assert r["gathers"] == [], r


def compiled_with_other_documents():
    """torch.compile (aot_eager) of the ringified llama3: two batches of other documents,
    after a first call under no_grad (CPU flex has no backward); one graph, exact."""
    import torch.distributed as dist
    from torch.nn.attention.flex_attention import flex_attention

    from ringify import ringify

    model = _model("llama3")
    world = dist.get_world_size()
    ringified = ringify(model, ring_size=world)
    run = torch.compile(ringified, backend="aot_eager")
    differences = []
    with _flex(flex_attention):
        tokens, positions = _inputs(model, 16 * world, True)
        with torch.no_grad():
            run(tokens, positions=positions, attention_masks=model.get_attention_masks(positions))
        for shift in (1, 3):
            tokens, positions = _inputs(model, 16 * world, True, shift=shift)
            masks = model.get_attention_masks(positions)
            with torch.no_grad():
                want = model(tokens, positions=positions, attention_masks=masks)
            got = run(tokens, positions=positions, attention_masks=masks)
            got.sum().backward()
            differences.append((got - want).abs().max().item())
    return differences, ringified.traces


def test_compiled_with_the_masks_of_other_documents(ranks):
    for differences, traces in ranks(2).run(compiled_with_other_documents, timeout=300):
        assert traces == 1 and max(differences) < TOL, (differences, traces)


def _titan_llama(sequence_parallel: bool = False):
    """torchtitan's llama3 (2 layers) with its sharding configs, as its trainer sets them."""
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    config = FAMILIES["llama3"]()
    config = dataclasses.replace(config, layers=config.layers[:2])
    set_llama3_sharding_config(config, enable_sp=sequence_parallel)
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    return config, model.double()


def _parallel_dims(cp: int, tp: int):
    """torchtitan's ParallelDims on gloo ranks (its meshes default to CUDA, which FSDP2 then
    asks for: this runs on the CPU), under its default spmd_types backend."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.distributed import ParallelDims

    parallel_dims.device_type = "cpu"
    dims = ParallelDims(
        dp_replicate=1, dp_shard=1, cp=cp, tp=tp, pp=1, ep=1, world_size=dist.get_world_size()
    )
    dims.build_mesh()
    return dims


def titan_tensor_parallel(fsdp: bool):
    """torchtitan 0.3's own TP (``Module.parallelize`` from the sharding configs) on a
    (cp, tp) mesh, then ringify over cp (and torchtitan's FSDP2 over its fsdp mesh, dp x cp:
    ``apply_fsdp_to_decoder``'s units, the final norm and head grouped in one, its divide
    factor 1): output and every gradient against the unparallelized model, each TP rank's
    shard of them."""
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.distributed.utils import get_spmd_context

    from ringify import ringify

    config, reference = _titan_llama()
    _, model = _titan_llama()
    dims = _parallel_dims(cp=2, tp=2)
    tp, cp = dims.get_mesh("tp"), dims.get_mesh("cp")
    context = get_spmd_context(parallel_dims=dims)
    with context():
        model.parallelize(dims)
    wrapper = model.layers["0"].attention.forward.__qualname__
    if fsdp:  # parallelize_llama's next steps: its full activation checkpointing, then
        # FSDP2 over dp_shard x cp flattened (the "loss" mesh, with no dp_replicate)
        FullAC.Config().build().apply(model)
        fsdp_mesh = dims.get_mesh("loss")
        apply_fsdp_to_decoder(model, fsdp_mesh, torch.float64, torch.float64, pp_enabled=False)
    tokens, positions = _inputs(model, 32, False)
    vocab = config.vocab_size // tp.size()
    mine = slice(tp.get_local_rank() * vocab, (tp.get_local_rank() + 1) * vocab)
    with _flex(dense_flex):
        want, want_grads = _step(reference, reference, tokens, positions)
    with _flex(flex_attention), context():
        ringified = ringify(model, ring_size=cp.size(), mesh=cp)
        masks = model.get_attention_masks(positions)
        with torch.no_grad():  # the trace under no_grad (CPU flex has no backward)
            ringified(tokens, positions=positions, attention_masks=masks)
        model.zero_grad(set_to_none=True)
        out = ringified(tokens, positions=positions, attention_masks=masks)
        weights = torch.randn(
            want.shape, generator=torch.Generator().manual_seed(7), dtype=want.dtype
        )
        (out * weights[..., mine]).sum().backward()  # as ``_step`` weighs the whole vocabulary
    # the reference's loss over the whole vocabulary: its gradients are the sum of the TP
    # ranks' losses' gradients, each rank's shard of them this rank's
    worst = 0.0
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        whole = want_grads[name.replace("._checkpoint_wrapped_module", "")]
        split = [d for d, (a, b) in enumerate(zip(grad.shape, whole.shape, strict=True)) if a != b]
        shard = whole.chunk(tp.size(), split[0])[tp.get_local_rank()] if split else whole
        worst = max(worst, ((grad - shard).abs().max() / shard.abs().max()).item())
    report = ringified.report()
    return {
        "units": report.fsdp_units,
        "checkpointed": report.checkpointed,
        "out": (out.detach() - want[..., mine]).abs().max().item(),
        "grads": worst,
        "gathers": [g.op for g in report.gathers],
        "tp collectives": len(report.tensor_parallel),
        "wrapper kept": wrapper == model.layers["0"].attention.forward.__qualname__,
    }


@pytest.mark.parametrize("fsdp", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_torchtitan_tensor_parallel_beside_the_ring(ranks, fsdp):
    """(cp, tp) = (2, 2): each module torchtitan wrapped runs its own forward on its local
    shards, between its redistributions over TP as ringify's TP ops; torchtitan's own CP
    axis is the ring's. Exact; the wrappers are the model's again after the trace. With
    parallelize_llama's activation checkpointing and FSDP2 after TP (slow): every unit kept,
    each block recomputed in the backward, the gradients reduced once."""
    units = ("", "tok_embeddings", "layers.0", "layers.1", "[norm, lm_head]") if fsdp else ()
    for r in ranks(4).run(titan_tensor_parallel, fsdp, timeout=600):
        assert r["out"] < TOL and r["grads"] < TOL and r["gathers"] == [], r
        assert sorted(r["units"]) == sorted(units), r
        assert r["checkpointed"] == tuple(f"{u}._checkpoint_wrapped_module" for u in units[2:4])
        assert r["tp collectives"] > 0 and r["wrapper kept"], r


def titan_refused(kind: str):
    """torchtitan parallelizing in a way ringify does not keep: sequence parallel inside its
    TP, or its own CP wrapper (``apply_cp_to_forward``, its DTensor backends' CP): ringify's
    error, on every rank."""
    import torch.distributed as dist
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.distributed.context_parallel.api import apply_cp_to_forward
    from torchtitan.distributed.utils import get_spmd_context

    from ringify import ringify

    world = dist.get_world_size()
    _, model = _titan_llama(sequence_parallel=kind == "sp")
    dims = _parallel_dims(cp=world if kind == "cp" else 1, tp=world if kind == "sp" else 1)
    with get_spmd_context(parallel_dims=dims)():
        if kind == "sp":
            model.parallelize(dims)
        else:
            layers = model.layers.values()
            apply_cp_to_forward([b.attention.inner_attention for b in layers], dims.get_mesh("cp"))
        tokens, positions = _inputs(model, 16 * world, False)
        masks = model.get_attention_masks(positions)
        try:
            with _flex(flex_attention), torch.no_grad():
                ringify(model, ring_size=world)(tokens, positions=positions, attention_masks=masks)
        except ValueError as e:
            return str(e)
    return None


@pytest.mark.parametrize("kind", ["sp", "cp"])
def test_what_torchtitan_parallelizes_that_ringify_does_not_keep(ranks, kind):
    """Refused, naming the setting to change, on every rank: sequence parallel would shard
    the sequence over TP too; torchtitan's CP wrapper would all-gather K/V under the ring."""
    setting = {"sp": "enable_sequence_parallel=False", "cp": "ringify is the context"}[kind]
    for error in ranks(2).run(titan_refused, kind, timeout=300):
        assert error is not None and setting in error, error
