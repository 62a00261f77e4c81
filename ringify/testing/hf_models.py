"""HF transformers models built from small configs with random weights, as tests and benchmarks
use them (SDPA attention, no dropout, no cache)."""

from __future__ import annotations


def gpt2(layers=2, dim=32, heads=4, vocab=64, max_len=128, attn_implementation="sdpa"):
    from transformers import GPT2Config, GPT2LMHeadModel

    return _built(
        GPT2Config, GPT2LMHeadModel, attn_implementation,
        n_layer=layers, n_embd=dim, n_head=heads, vocab_size=vocab, n_positions=max_len,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip


def llama(layers=2, dim=32, heads=4, kv_heads=2, vocab=64, max_len=128, attn_implementation="sdpa"):
    """HF Llama: RoPE tables from positions, grouped-query attention, RMSNorm, SwiGLU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = (layers, dim, heads, kv_heads, vocab, max_len)
    return _decoder(LlamaConfig, LlamaForCausalLM, *shape, attn_implementation=attn_implementation)


def mistral(window: int, layers=2, dim=32, heads=4, kv_heads=2, vocab=64, max_len=1 << 20):
    """HF Mistral: Llama's blocks with a sliding-window causal mask of ``window`` tokens."""
    from transformers import MistralConfig, MistralForCausalLM

    shape = (layers, dim, heads, kv_heads, vocab, max_len)
    return _decoder(MistralConfig, MistralForCausalLM, *shape, sliding_window=window)


def _decoder(
    config_class,
    model_class,
    layers,
    dim,
    heads,
    kv_heads,
    vocab,
    max_len,
    attn_implementation="sdpa",
    **extra,
):
    """A Llama-family causal LM (no cache) of the given shape, SDPA unless told."""
    return _built(
        config_class, model_class, attn_implementation,
        hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=dim // heads,
        vocab_size=vocab, max_position_embeddings=max_len, use_cache=False, bos_token_id=0,
        eos_token_id=0, pad_token_id=0, **extra,
    )  # fmt: skip


def t5(encoder_only: bool = False, layers=2, dim=32, heads=4, vocab=64):
    """HF T5: a learned relative-position bias added to every attention's scores."""
    from transformers import T5Config, T5EncoderModel, T5ForConditionalGeneration

    return _built(
        T5Config, T5EncoderModel if encoder_only else T5ForConditionalGeneration, "sdpa",
        vocab_size=vocab, d_model=dim, d_kv=dim // heads, d_ff=2 * dim, num_layers=layers,
        num_heads=heads, relative_attention_num_buckets=8, dropout_rate=0.0, use_cache=False,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip


def falcon(new_decoder_architecture: bool, layers=2, dim=32, heads=4, vocab=64):
    """HF Falcon, multi-query (one k/v head) or the new decoder architecture (k/v groups):
    q, k and v are picked out of the fused projection with a constant index on the head dim."""
    from transformers import FalconConfig, FalconForCausalLM

    return _built(
        FalconConfig, FalconForCausalLM, "sdpa",
        vocab_size=vocab, hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads,
        num_kv_heads=2 if new_decoder_architecture else None,
        new_decoder_architecture=new_decoder_architecture,
        multi_query=not new_decoder_architecture,
        alibi=False, use_cache=False, attention_dropout=0.0, hidden_dropout=0.0, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip


def vit(layers=2, dim=32, heads=4, image_size=32, patch_size=8):
    """HF ViT: a conv patch embedding, then a cls token concatenated in front of the patches."""
    from transformers import ViTConfig, ViTModel

    return _built(
        ViTConfig, ViTModel, "sdpa",
        hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=2 * dim, image_size=image_size, patch_size=patch_size, num_channels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip


def whisper_encoder(layers=2, dim=32, heads=4, mel_bins=8, frames=32):
    """HF Whisper's encoder: two convolutions over the audio frames (the second halves them)."""
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    return _built(
        WhisperConfig, WhisperEncoder, "sdpa",
        d_model=dim, encoder_layers=layers, encoder_attention_heads=heads, encoder_ffn_dim=2 * dim,
        num_mel_bins=mel_bins, max_source_positions=frames // 2, dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip


def modernbert(layers=2, dim=32, heads=4, vocab=64, window=8):
    """HF ModernBERT: global and local (sliding-window) layers, a RoPE table per layer type
    built in ``set`` order (so in another order under another ``PYTHONHASHSEED``)."""
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    return _built(
        ModernBertConfig, ModernBertForMaskedLM, "sdpa",
        vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
        num_attention_heads=heads,
        layer_types=[("full_attention", "sliding_attention")[i % 2] for i in range(layers)],
        local_attention=window, max_position_embeddings=128,
        attention_dropout=0.0, mlp_dropout=0.0, embedding_dropout=0.0, pad_token_id=0,
        bos_token_id=0, eos_token_id=0, cls_token_id=0, sep_token_id=0,
    )  # fmt: skip


def gemma3(layers=2, dim=32, heads=4, kv_heads=2, vocab=64, window=8):
    """HF Gemma3 (text): sliding and full layers, a RoPE table per layer type built in
    ``set`` order."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return _built(
        Gemma3TextConfig, Gemma3ForCausalLM, "sdpa",
        vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=dim // heads,
        layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
        sliding_window=window, max_position_embeddings=128, use_cache=False, pad_token_id=0,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


def wav2vec2(layers=2, dim=32, heads=4, kernel=8, groups=4):
    """HF Wav2Vec2: strided convolutions over raw audio (a frame per 4 samples here), then a
    positional convolution of ``kernel`` frames along the sequence (its last output cut when
    ``kernel`` is even) before the encoder."""
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    return _built(
        Wav2Vec2Config, Wav2Vec2Model, "sdpa",
        hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=2 * dim, conv_dim=(16, 16), conv_stride=(2, 2), conv_kernel=(2, 2),
        num_conv_pos_embeddings=kernel, num_conv_pos_embedding_groups=groups,
        feat_extract_norm="group", apply_spec_augment=False, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0,
    )  # fmt: skip


def siglip_vision(layers=2, dim=32, heads=4, image_size=16, patch_size=4):
    """HF SigLIP's vision tower with its attention-pooling head: one learned probe attends to
    every patch through ``nn.MultiheadAttention`` (its weights computed, then dropped)."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    return _built(
        SiglipVisionConfig, SiglipVisionModel, "sdpa",
        hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
        num_attention_heads=heads, image_size=image_size, patch_size=patch_size, num_channels=3,
        vision_use_head=True,
    )  # fmt: skip


def gemma2(layers=2, dim=32, heads=4, kv_heads=2, vocab=64, window=8):
    """HF Gemma 2 with its eager attention (HF refuses SDPA for it): scores soft-capped
    before the mask, sliding and full layers, and the final logits capped too."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return _built(
        Gemma2Config, Gemma2ForCausalLM, "eager",
        vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=dim // heads,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0, sliding_window=window,
        query_pre_attn_scalar=dim // heads, max_position_embeddings=256, use_cache=False,
        pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


def bloom(layers=2, dim=32, heads=4, vocab=64):
    """HF BLOOM (eager only): ALiBi added by ``baddbmm`` to (B * H, S, S) scores, viewed
    4-D for the causal mask and back for the product with v."""
    from transformers import BloomConfig, BloomForCausalLM

    return _built(
        BloomConfig, BloomForCausalLM, "eager",
        vocab_size=vocab, hidden_size=dim, n_layer=layers, n_head=heads, use_cache=False,
        pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


def _built(config_class, model_class, attn_implementation: str, **fields):
    """``model_class`` with random weights, from ``config_class(**fields)`` (as ``hf_moe.py``'s,
    without its MoE defaults)."""
    config = config_class(**fields)
    config._attn_implementation = attn_implementation
    return model_class(config)
