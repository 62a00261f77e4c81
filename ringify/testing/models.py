"""Small models for tests and benchmarks, written as users write them (nothing ringify-specific)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, attend=F.scaled_dot_product_attention):
        super().__init__()
        self.heads, self.attend = heads, attend
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.fc, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = self.attend(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class NanoGPT(nn.Module):
    """nanoGPT's shape: learned positions, tied embeddings, the loss inside forward.

    ``attend`` is the attention function (SDPA; a test swaps in ``dilated_attention``).
    """

    def __init__(
        self,
        vocab=64,
        max_len=128,
        dim=32,
        heads=4,
        layers=2,
        attend=F.scaled_dot_product_attention,
    ):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, attend) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


class RunningModel(nn.Module):
    """Attention followed by an op over the sequence: ``"cumsum"`` (a scan over the ring),
    ``"pool"`` (max and min pooling: maxima over the ring), ``"argmax"``, ``"softmax"``
    (normalised over the ring) or ``"cummax"`` (no rule: gathered)."""

    def __init__(self, running: str = "cumsum", dim=16, heads=2):
        super().__init__()
        self.heads, self.running = heads, running
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).split(c, dim=-1)
        )
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, c)
        if self.running == "cummax":
            return self.out(y.cummax(dim=1).values)
        if self.running == "pool":
            centred = (y - y.amax(1, keepdim=True)).exp().sum(1)  # the max meets the sequence
            centred = centred + (y - y.mean(1, keepdim=True)).square().sum(1)  # and the mean
            return self.out(y.amax(1) - y.amin(1, keepdim=True).squeeze(1)) + y.max() + centred
        if self.running == "argmax":  # the position of each row's largest activation
            where = y.sum(-1).argmax(1, keepdim=True) + y.mean(-1).argmax(1).unsqueeze(-1)
            return self.out(y.amax(1)) * where.to(y.dtype)
        if self.running == "softmax":  # attention pooling over the sequence
            weights = y.softmax(1) + y.log_softmax(1, dtype=torch.float64).exp()
            return self.out((weights * y).sum(1))
        return self.out(y.cumsum(dim=1))


def gpt2(layers=2, dim=32, heads=4, vocab=64, max_len=128):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=layers,
        n_embd=dim,
        n_head=heads,
        vocab_size=vocab,
        n_positions=max_len,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    config._attn_implementation = "sdpa"
    return GPT2LMHeadModel(config)


def llama(layers=2, dim=32, heads=4, kv_heads=2, vocab=64, max_len=128):
    """HF Llama: RoPE tables from positions, grouped-query attention, RMSNorm, SwiGLU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=dim,
        intermediate_size=2 * dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=max_len,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def transformer_encoder(dim=32, heads=4, layers=2):
    layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def t5(encoder_only: bool = False, layers=2, dim=32, heads=4, vocab=64):
    """HF T5: a learned relative-position bias added to every attention's scores."""
    from transformers import T5Config, T5EncoderModel, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=vocab,
        d_model=dim,
        d_kv=dim // heads,
        d_ff=2 * dim,
        num_layers=layers,
        num_heads=heads,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,
        use_cache=False,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    config._attn_implementation = "sdpa"
    return (T5EncoderModel if encoder_only else T5ForConditionalGeneration)(config)


class BiasedAttention(nn.Module):
    """Self-attention with a learned (heads, S, S) bias parameter as its float mask."""

    def __init__(self, seq: int, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.bias = nn.Parameter(torch.randn(heads, seq, seq) * 0.1)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for z in self.qkv(x).split(c, 2)
        )
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)
        return y.transpose(1, 2).reshape(b, t, c)


def falcon(new_decoder_architecture: bool, layers=2, dim=32, heads=4, vocab=64):
    """HF Falcon, multi-query (one k/v head) or the new decoder architecture (k/v groups):
    q, k and v are picked out of the fused projection with a constant index on the head dim."""
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(
        vocab_size=vocab,
        hidden_size=dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=2 if new_decoder_architecture else None,
        new_decoder_architecture=new_decoder_architecture,
        multi_query=not new_decoder_architecture,
        alibi=False,
        use_cache=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    config._attn_implementation = "sdpa"
    return FalconForCausalLM(config)
