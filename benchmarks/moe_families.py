"""Mixture-of-experts and MLA language models of HF transformers on the ring: exactness, gathers.

Each ``model_type`` is built from its own config class shrunk to a tiny model (the fields
below, where the class takes them; random weights, float64, SDPA, experts by
``batched_mm``), ringified on ``--ranks`` gloo ranks, and compared with the unmodified model:
the largest difference of the logits and of every parameter gradient (the loss: the logits
times fixed random weights). "own reordering": the unmodified model's gradients with its
batch rows swapped, which shows where a family computes in float32 inside a float64 model
(a router in float32). Training mode, one seed before each forward (a router that samples,
as PhiMoE's, draws alike). Counted, not timed.

    python -m benchmarks.moe_families --ranks 2
"""

from __future__ import annotations

import inspect

from benchmarks.families import compared, main

FAMILIES = (
    "qwen2_moe", "olmoe", "granitemoe", "phimoe", "glm4_moe", "glm4_moe_lite", "ernie4_5_moe",
    "dots1", "hunyuan_v1_moe", "flex_olmo", "jetmoe", "deepseek_v2", "minicpm3",
)  # fmt: skip
MLA = ("deepseek_v2", "minicpm3", "glm4_moe_lite")  # as many K/V heads as query heads
SMALL = {
    "vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "intermediate_size": 64, "head_dim": 8, "kv_channels": 8,
    "max_position_embeddings": 256, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0,
    "use_cache": False, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
    "moe_num_experts": 4, "num_experts_per_tok": 2, "moe_k": 2, "moe_topk": 2,
    "moe_intermediate_size": 16, "n_shared_experts": 1, "shared_expert_intermediate_size": 16,
    "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "norm_topk_prob": True,
    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8,
    "v_head_dim": 8,
}  # fmt: skip


def build(kind: str, **fields):
    """A tiny random ``kind`` causal LM (``fields``: config fields beside ``SMALL``)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[kind]
    takes = inspect.signature(config_class.__init__).parameters
    small = SMALL | fields
    config = config_class(**{k: v for k, v in small.items() if k in takes})
    for k, v in small.items():  # fields a config sets from **kwargs
        if k not in takes and hasattr(config, k):
            setattr(config, k, v)
    if kind in MLA:
        config.num_key_value_heads = config.num_attention_heads
    config._attn_implementation = "sdpa"
    config._experts_implementation = "batched_mm"
    return AutoModelForCausalLM.from_config(config).double()


def _grads(model, run, ids, weights, flipped: bool = False):
    import torch

    model.zero_grad(set_to_none=True)
    torch.manual_seed(11)
    logits = run(input_ids=ids.flip(0) if flipped else ids).logits
    logits = logits.flip(0) if flipped else logits
    (logits * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def compare(kind: str, world: int, **fields) -> dict:
    import torch

    from ringify import ringify

    torch.manual_seed(0)
    model = build(kind, **fields)
    ids = torch.randint(1, 64, (2, 16 * world), generator=torch.Generator().manual_seed(1))
    weights = torch.randn(2, 16 * world, 64, generator=torch.Generator().manual_seed(5))
    weights = weights.double()
    want_logits, want = _grads(model, model, ids, weights)
    _, own = _grads(model, model, ids, weights, flipped=True)
    ringified = ringify(model, ring_size=world)
    ringified(input_ids=ids)  # traced first: the trace draws on fake tensors
    got_logits, got = _grads(model, ringified, ids, weights)
    report = ringified.report()
    return {
        "family": kind,
        "logits": (got_logits - want_logits).abs().max().item(),
        **compared(want, got, own, report),
    }


if __name__ == "__main__":
    main(__doc__, FAMILIES, compare)
