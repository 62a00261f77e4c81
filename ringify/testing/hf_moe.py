"""HF mixture-of-experts LMs from small configs with random weights, as tests and benchmarks
build them (nothing downloaded): Qwen3-MoE, Mixtral, DeepSeek-V3 (group-limited routing and
MLA) and gpt-oss (attention sinks, biased experts, sliding and full layers); more of the class:
DeepSeek-V2 (MLA), OLMoE, JetMoE (mixture of attention heads), PhiMoE (a sampling router
in training) and Llama 4's text model (every token through every expert, weighted; chunked
attention). Each returns its
router logits with ``output_router_logits`` and adds the load-balancing loss to its loss."""

from __future__ import annotations

_SHAPE = {"vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2}
_TOKENS = {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0, "use_cache": False}


def _built(config_class, model_class, attn_implementation="sdpa", **fields):
    """The model, its experts run by HF's ``batched_mm`` (the implementation that takes every
    dtype; ``grouped_mm`` takes no float64)."""
    config = config_class(**(_SHAPE | _TOKENS | fields))
    config._attn_implementation = attn_implementation
    config._experts_implementation = "batched_mm"
    return model_class(config)


def qwen3_moe(layers=2, experts=4, top_k=2):
    """HF Qwen3-MoE: every layer sparse, top-k routing with normalised weights."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return _built(
        Qwen3MoeConfig, Qwen3MoeForCausalLM, num_hidden_layers=layers, head_dim=8,
        intermediate_size=64, moe_intermediate_size=16, num_experts=experts,
        num_experts_per_tok=top_k, norm_topk_prob=True, output_router_logits=True,
        max_position_embeddings=256,
    )  # fmt: skip


def mixtral(layers=2, experts=4, top_k=2):
    """HF Mixtral: sparse layers with a softmax over the top-k router logits."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return _built(
        MixtralConfig, MixtralForCausalLM, num_hidden_layers=layers, head_dim=8,
        intermediate_size=64, num_local_experts=experts, num_experts_per_tok=top_k,
        output_router_logits=True, max_position_embeddings=256,
    )  # fmt: skip


def deepseek_v3(layers=2, experts=8, top_k=2):
    """HF DeepSeek-V3: MLA (q/k head dim 12 = 8 without RoPE + 4 with it, v head dim 8, as many
    K/V heads as query heads), a dense first layer, then shared and routed experts with
    group-limited routing."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    return _built(
        DeepseekV3Config, DeepseekV3ForCausalLM, num_hidden_layers=layers,
        intermediate_size=64, moe_intermediate_size=16, n_shared_experts=1,
        n_routed_experts=experts, num_experts_per_tok=top_k, n_group=2, topk_group=1,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=256, num_key_value_heads=4,
    )  # fmt: skip


def gpt_oss(layers=2, experts=4, top_k=2, window=8):
    """HF gpt-oss: a learned sink logit per head (eager attention only, as HF runs it),
    experts with biases and a clamped SwiGLU, sliding and full layers."""
    from transformers import GptOssConfig, GptOssForCausalLM

    return _built(
        GptOssConfig, GptOssForCausalLM, num_hidden_layers=layers, head_dim=8,
        intermediate_size=16, num_local_experts=experts, num_experts_per_tok=top_k,
        sliding_window=window, output_router_logits=True, max_position_embeddings=256,
        layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
        attn_implementation="eager",
    )  # fmt: skip


def deepseek_v2(layers=2, experts=4, top_k=2):
    """HF DeepSeek-V2: MLA (q/k head dim 12, v head dim 8) and shared plus routed experts."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    return _built(
        DeepseekV2Config, DeepseekV2ForCausalLM, num_hidden_layers=layers,
        intermediate_size=64, moe_intermediate_size=16, n_shared_experts=1,
        n_routed_experts=experts, num_experts_per_tok=top_k, first_k_dense_replace=1,
        kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
        max_position_embeddings=256, num_key_value_heads=4,
    )  # fmt: skip


def olmoe(layers=2, experts=4, top_k=2):
    """HF OLMoE: every layer sparse, QK norms."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    return _built(
        OlmoeConfig, OlmoeForCausalLM, num_hidden_layers=layers, intermediate_size=16,
        num_experts=experts, num_experts_per_tok=top_k, output_router_logits=True,
        max_position_embeddings=256,
    )  # fmt: skip


def jetmoe(layers=2, experts=4, top_k=2):
    """HF JetMoE: experts in the attention too (each token's query heads from its routed
    experts, indexed by the data), and in the MLP."""
    from transformers import JetMoeConfig, JetMoeForCausalLM

    config = JetMoeConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=layers, num_key_value_heads=2,
        kv_channels=8, intermediate_size=64, num_local_experts=experts, output_router_logits=True,
        num_experts_per_tok=top_k, max_position_embeddings=256, pad_token_id=0,
        bos_token_id=0, eos_token_id=0, use_cache=False,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    config._experts_implementation = "batched_mm"
    return JetMoeForCausalLM(config)


def phimoe(layers=2, experts=4, top_k=2):
    """HF PhiMoE: the sparse mixer, which in training samples each token's experts (Gumbel
    noise) and scales their gradients by a custom autograd Function."""
    from transformers import PhimoeConfig, PhimoeForCausalLM

    return _built(
        PhimoeConfig, PhimoeForCausalLM, num_hidden_layers=layers, intermediate_size=64,
        num_local_experts=experts, num_experts_per_tok=top_k, output_router_logits=True,
        max_position_embeddings=256,
    )  # fmt: skip


def llama4(layers=2, experts=4):
    """HF Llama 4's text model: its MoE repeats the tokens once per expert and weighs each
    copy by its router score; chunked attention (chunks of 8) beside full attention, with
    its attention temperature tuning over the positions."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    return _built(
        Llama4TextConfig, Llama4ForCausalLM, num_hidden_layers=layers, head_dim=8,
        intermediate_size=32, intermediate_size_mlp=64, num_local_experts=experts,
        num_experts_per_tok=1, attention_chunk_size=8, floor_scale=8,
        layer_types=["chunked_attention", "full_attention"][:layers],
        no_rope_layers=[1, 0][:layers], max_position_embeddings=256,
        output_router_logits=True,
    )  # fmt: skip
