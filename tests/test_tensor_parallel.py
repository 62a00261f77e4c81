"""Tensor parallelism beside the ring, on a (tp, cp) = (2, 2) gloo mesh: a model parallelized
for TP the two ways users do it (transformers' own ``tp_plan``; torch's ``parallelize_module``
with torchtitan's plan), then ``ringify(model, ring_size=2, mesh=mesh["cp"])``, gives the
unmodified model's loss, logits and every gradient (float64, the global batch), with its
causal, right-padded and packed masks, eager and compiled. Plans ringify cannot keep
(sequence parallel, loss parallel, other styles) are refused on every rank, naming what
composes. The pass's structure: one ``tp_copy`` per input read by column-parallel layers,
one ``tp_reduce`` per row-parallel layer, and TP's group names invisible to the ring's
agreement on graphs."""

from __future__ import annotations

import pytest
import torch

from ringify import ringify
from ringify.testing import outcome
from ringify.testing.tolerance import EXACT, FACTOR

S = 24  # sequence length (global)


def _mesh(dims=("tp", "cp")):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2,) * len(dims), mesh_dim_names=dims)


def _hf_inputs(case: str) -> dict:
    ids = torch.randint(1, 64, (2, S), generator=torch.Generator().manual_seed(1))
    kwargs = {"input_ids": ids, "labels": ids}
    if case == "right":
        mask = torch.ones(2, S, dtype=torch.long)
        mask[1, -7:] = 0
        kwargs["attention_mask"] = mask
    if case == "packed":
        kwargs["position_ids"] = torch.cat([torch.arange(n) for n in (5, 7, 12)]).expand(2, -1)
    return kwargs


def _hf_model(family: str):
    """HF Llama; Qwen2 (q/k/v biases); Qwen3 (a per-head q_norm and k_norm, whole on every TP
    rank, their gradients partial)."""
    import transformers as tf

    from ringify.testing import hf_models

    if family == "qwen2":
        model = hf_models._decoder(tf.Qwen2Config, tf.Qwen2ForCausalLM, 2, 32, 4, 2, 64, 128)
    elif family == "qwen3":
        model = hf_models._decoder(tf.Qwen3Config, tf.Qwen3ForCausalLM, 2, 32, 4, 2, 64, 128)
    else:
        model = hf_models.llama()
    return model.double()


def _hf_parallelized(model, tp_mesh, tp_plan=None):
    """transformers' own TP: from 5.2x, the plan resolved per layer and applied; before, the
    model's ``tp_plan`` applied as it is."""
    from transformers import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    if not hasattr(model, "_resolve_parallel_plans"):  # transformers 5.16
        model.tp_plan = model.tp_plan | (tp_plan or {})
        return apply_tensor_parallelism(model, tp_mesh)
    config = DistributedConfig(tp_size=2, tp_plan=tp_plan)
    plan, _, _ = model._resolve_parallel_plans(config)
    return apply_tensor_parallelism(model, tp_mesh, plan)


def _differences(model, reference, got, want) -> dict:
    from torch.distributed.tensor import DTensor

    def whole(g):
        return g.full_tensor() if isinstance(g, DTensor) else g

    wanted = dict(reference.named_parameters())
    return {
        "out": max((a - b).abs().max().item() for a, b in zip(got, want, strict=True)),
        "grads": max(
            (whole(p.grad) - wanted[n].grad).abs().max().item() for n, p in model.named_parameters()
        ),
        "dtensor grads": all(
            isinstance(p.grad, DTensor) for p in model.parameters() if isinstance(p, DTensor)
        ),
    }


def _bound(reference, kwargs: dict, logits) -> float:
    """Inductor computes what HF computes in float32 (its RoPE tables, the loss) in another
    order than eager: the unmodified model's own move under Inductor, measured here, sets
    the bound (``ringify.testing.tolerance``)."""
    import copy

    torch._dynamo.reset()
    model = copy.deepcopy(reference)
    model.zero_grad(set_to_none=True)
    got = torch.compile(model)(**kwargs)
    got.loss.backward()
    moved = _differences(model, reference, [got.logits], [logits])
    return max(EXACT, FACTOR * max(moved["out"], moved["grads"]))


def hf_case(family: str, case: str, backend: str = "eager") -> dict:
    import copy

    from torch.distributed.tensor import DTensor

    mesh = _mesh()
    torch.manual_seed(0)
    reference = _hf_model(family)
    model = copy.deepcopy(reference)
    kwargs = _hf_inputs(case)
    want = reference(**kwargs)
    want.loss.backward()
    ringified = ringify(_hf_parallelized(model, mesh["tp"]), ring_size=2, mesh=mesh["cp"])
    run = ringified if backend == "eager" else torch.compile(ringified, backend=backend)
    got = run(**kwargs)
    got.loss.backward()
    report = ringified.report()
    return {
        # (HF computes the loss in float32: its logits and gradients are float64)
        **_differences(model, reference, [got.logits], [want.logits]),
        "bound": _bound(reference, kwargs, want.logits) if backend == "inductor" else EXACT,
        "gathers": len(report.gathers),
        "collectives": len(report.tensor_parallel),
        "embedding split": isinstance(model.model.embed_tokens.weight, DTensor),
        "heads": [a.local_shape[1] for a in report.rewritten],
    }


@pytest.mark.parametrize(
    "family, case, backend",
    [
        ("llama", "causal", "eager"),
        ("llama", "right", "eager"),
        ("llama", "packed", "aot_eager"),
        pytest.param("qwen2", "causal", "aot_eager", marks=pytest.mark.slow),
        ("qwen2", "packed", "eager"),
        ("qwen3", "packed", "eager"),
    ],
)
def test_hf_base_model_tp_plan_beside_the_ring_is_exact(ranks, family, case, backend):
    for r in ranks(4).run(hf_case, family, case, backend, timeout=300):
        assert r["out"] <= EXACT and r["grads"] <= EXACT, r
        assert r["gathers"] == 0 and r["dtensor grads"], r
        # per block: q, k, v's input copied once, o_proj's sum, the MLP's input copied once,
        # down_proj's sum; the vocabulary's sum; the head's input and its gather. 4 heads
        # over TP of 2.
        # (transformers 5.16's plans leave the embedding whole); Qwen3's q_norm and k_norm
        # weights each get their partial gradients summed
        norms = 2 * 2 if family == "qwen3" else 0
        assert r["collectives"] == 2 * 4 + r["embedding split"] + 2 + norms, r
        assert r["heads"] == [2, 2], r


@pytest.mark.slow
def test_hf_tp_plan_beside_the_ring_under_inductor(ranks):
    for r in ranks(4).run(hf_case, "llama", "right", "inductor", timeout=600):
        assert r["out"] <= r["bound"] and r["grads"] <= r["bound"], r


def titan_case(case: str, backend: str = "eager") -> dict:
    import copy

    from ringify.testing.titan import Transformer, parallelize

    mesh = _mesh()
    torch.manual_seed(0)
    reference = Transformer().double()
    model = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(1)
    tokens, labels = (torch.randint(0, 96, (2, S), generator=g) for _ in range(2))
    positions = None
    if case == "packed":
        positions = torch.cat([torch.arange(n) for n in (7, 17)]).expand(2, -1)
    want = reference(tokens, labels, positions)
    want.backward()
    ringified = ringify(parallelize(model, mesh["tp"]), ring_size=2, mesh=mesh["cp"])
    run = ringified if backend == "eager" else torch.compile(ringified, backend=backend)
    got = run(tokens, labels, positions)
    got.backward()
    graph = ringified._last().module.graph
    ops = [str(n.target) for n in graph.nodes if str(n.target).startswith("ringify.tp_")]
    blocks = [c for c in ringified.report().tensor_parallel if c.layers.startswith("layers.")]
    return {
        **_differences(model, reference, [got], [want]),
        "gathers": len(ringified.report().gathers),
        "ops": {op: ops.count(op) for op in set(ops)},
        "block bytes": sum(c.sent_bytes for c in blocks),
    }


@pytest.mark.parametrize("case, backend", [("causal", "eager"), ("packed", "aot_eager")])
def test_torchtitan_plan_beside_the_ring_is_exact(ranks, case, backend):
    for r in ranks(4).run(titan_case, case, backend, timeout=300):
        assert r["out"] <= EXACT and r["grads"] <= EXACT, r
        assert r["gathers"] == 0, r
        # per block: one tp_copy for q, k, v's input and one for the MLP's, one tp_reduce
        # after wo and one after w2; the vocabulary's lookup and sum; the head's gather
        assert r["ops"] == {
            "ringify.tp_copy.default": 2 * 2 + 1,
            "ringify.tp_reduce.default": 2 * 2 + 1,
            "ringify.tp_vocab_embedding.default": 1,
            "ringify.tp_gather.default": 1,
        }, r
        # 2 blocks x 4 all-reduces of this rank's (2, S / 2, 64) float64 activations, a ring
        # all-reduce over 2 ranks sending 2 (2 - 1) / 2 of each
        assert r["block bytes"] == 2 * 4 * (2 * S // 2 * 64 * 8), r


def refused(plan: str):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from ringify.testing.titan import Transformer, parallelize

    mesh = _mesh()
    torch.manual_seed(0)
    if plan == "generate":
        model = _hf_parallelized(_hf_model("llama"), mesh["tp"]).eval()
        ringified = ringify(model, ring_size=2, mesh=mesh["cp"])
        ids = torch.randint(1, 64, (1, S))
        return outcome(lambda: ringified.generate(ids, max_new_tokens=2))
    if plan == "hf sequence parallel":
        norms = {"model.layers.*.input_layernorm": "sequence_parallel"}
        model = _hf_parallelized(_hf_model("llama"), mesh["tp"], tp_plan=norms)
        ids = torch.randint(1, 64, (2, S))
        return outcome(lambda: ringify(model, ring_size=2, mesh=mesh["cp"])(input_ids=ids))
    model = Transformer().double()
    block = model.layers[0]
    if plan == "sequence parallel":
        parallelize_module(
            block,
            mesh["tp"],
            {
                "attention_norm": SequenceParallel(),
                "attention.wq": ColwiseParallel(input_layouts=Shard(1)),
            },
        )
    elif plan == "loss parallel":
        parallelize_module(model, mesh["tp"], {"output": ColwiseParallel(use_local_output=False)})
    elif plan == "embedding ids sharded":
        parallelize_module(model, mesh["tp"], {"tok_embeddings": RowwiseParallel()})
    elif plan == "unknown style":
        style = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)
        )
        parallelize_module(block, mesh["tp"], {"attention": style})
    elif plan == "ring over tp":
        tokens = torch.randint(0, 96, (2, S))
        parallelize(model, mesh["tp"])
        return outcome(lambda: ringify(model, ring_size=2, mesh=mesh["tp"])(tokens))
    tokens = torch.randint(0, 96, (2, S))
    return outcome(lambda: ringify(model, ring_size=2, mesh=mesh["cp"])(tokens))


@pytest.mark.parametrize(
    "plan, says",
    [
        ("sequence parallel", "Shard(1)"),
        ("hf sequence parallel", "Shard(1)"),
        ("loss parallel", "use_local_output=True"),
        ("embedding ids sharded", "input_layouts=Replicate()"),
        ("generate", "generate on a model parallelized for tensor parallelism"),
        ("ring over tp", 'mesh=mesh["cp"]'),
        ("unknown style", "PrepareModuleInput): ringify cannot keep this parallel style"),
    ],
)
def test_plans_ringify_cannot_keep_are_refused_on_every_rank(ranks, plan, says):
    for kind, message, _ in ranks(4).run(refused, plan):
        assert kind == "ValueError" and says in message, message
        named = plan in ("generate", "ring over tp")
        assert named or "What composes with ringify" in message, message


def three_d(backend: str, folder: str) -> dict:
    """torchtitan's order on a (dp, tp, cp) = (2, 2, 2) mesh: TP, per-block FSDP2 over dp,
    FSDP2 on the model, then ringify over cp; one step, then a DCP checkpoint of the result
    loaded into the unmodified model."""
    import copy

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from ringify.testing.titan import Transformer, parallelize

    mesh = _mesh(("dp", "tp", "cp"))
    torch.manual_seed(0)
    reference = Transformer().double()
    model = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(1)
    tokens, labels = (torch.randint(0, 96, (2, S), generator=g) for _ in range(2))
    positions = torch.cat([torch.arange(n) for n in (7, 17)]).expand(2, -1)
    want = reference(tokens, labels, positions)
    want.backward()
    parallelize(model, mesh["tp"])
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    ringified = ringify(model, ring_size=2, mesh=mesh["cp"])
    run = ringified if backend == "eager" else torch.compile(ringified, backend=backend)
    got = run(tokens, labels, positions)
    got.backward()
    state = get_model_state_dict(ringified)
    dcp.save(state, checkpoint_id=folder)
    loaded = Transformer().double()
    plain = loaded.state_dict()
    dcp.load(plain, checkpoint_id=folder)
    loaded.load_state_dict(plain)
    return {
        **_differences(model, reference, [got], [want]),
        "keys": sorted(state) == sorted(reference.state_dict()),
        "loaded": max(
            (p.full_tensor() - q).abs().max().item()
            for p, q in zip(model.parameters(), loaded.parameters(), strict=True)
        ),
    }


def _on_8_ranks(backends: list[str], folder) -> None:
    from ringify.testing import RankPool

    pool = RankPool(8)  # oversubscribed: a throwaway pool, not kept for the session
    try:
        for backend in backends:
            for r in pool.run(three_d, backend, str(folder / backend), timeout=600):
                assert r["out"] <= EXACT and r["grads"] <= EXACT, (backend, r)
                assert r["keys"] and r["loaded"] == 0, (backend, r)
    finally:
        pool.close()


@pytest.mark.slow  # 8 ranks on 2 cores: CI's slow pass runs it (the (tp, cp) cases are default)
def test_fsdp2_over_tp_beside_the_ring_is_exact_and_checkpoints_the_models_keys(tmp_path):
    _on_8_ranks(["eager"], tmp_path)


@pytest.mark.slow  # two compilers on 8 ranks of a 2-core machine
def test_fsdp2_over_tp_beside_the_ring_compiled(tmp_path):
    _on_8_ranks(["aot_eager", "inductor"], tmp_path)
