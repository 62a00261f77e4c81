"""``RingifiedModule.generate``: greedy and sampled generation with the KV cache split across the ring.

The prompt is prefilled by the ringified model (``outputs="sharded"``): each rank keeps
its part of every layer's K/V, never the whole cache. Each new token then runs the
decode step (``generation/step.py``, traced once) on every rank: its query, key and
value replicated (one row), attention over each rank's part merged by log-sum-exp, and
its K/V stored on one rank (``generation/step.py``).

It follows HF ``GenerationMixin.generate`` for what it supports: ``max_new_tokens`` /
``max_length``, greedy or ``do_sample`` with ``temperature``, ``top_k``, ``top_p`` and
``min_p``, ``eos_token_id`` (finished rows continue with ``pad_token_id``), and
``return_dict_in_generate`` with ``output_scores``/``output_logits``. Other options raise.
The prompt is left-padded to a length the ring splits (masked, and with HF's position
ids, as HF pads a batch); sampled tokens are drawn on the ring's first rank and
broadcast, so every rank continues alike.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ringify.generation.step import DecodeStep, ShardedCache
from ringify.passes.decode import SUPPORTED
from ringify.runtime.collectives.layout import shard_for_rank, split_multiple
from ringify.runtime.collectives.ring import Ring
from ringify.tracing.caches import cache_field, cache_keyword, cache_of

# options that change what is generated, at their neutral values: any other value is refused
_UNSUPPORTED = {
    "num_beams": 1, "num_return_sequences": 1, "repetition_penalty": 1.0, "penalty_alpha": None,
    "no_repeat_ngram_size": 0, "min_new_tokens": None, "min_length": 0, "bad_words_ids": None,
    "force_words_ids": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None,
    "guidance_scale": None, "suppress_tokens": None, "begin_suppress_tokens": None,
    "sequence_bias": None, "renormalize_logits": False, "stop_strings": None,
    "encoder_repetition_penalty": 1.0, "exponential_decay_length_penalty": None,
    "watermarking_config": None, "prompt_lookup_num_tokens": None,
    "assistant_early_exit": None, "max_time": None, "constraints": None,
}  # fmt: skip
_SUPPORTED = (
    "max_new_tokens, max_length, do_sample, temperature, top_k, top_p, min_p, eos_token_id, "
    "pad_token_id, return_dict_in_generate, output_scores, output_logits"
)


@torch.no_grad()
def generate(
    gen: Generation, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs
):
    """Generate from ``input_ids`` (B, L) with ``gen``'s model on its ring."""
    if gen.model.training:
        raise ValueError("ringify's generate runs in eval mode: call model.eval() first")
    config = _generation_config(gen.model, kwargs)
    new_tokens = config.max_new_tokens or config.max_length - input_ids.shape[1]
    started = prefill(gen, input_ids, attention_mask, new_tokens, _pad_id(config))
    return decode(gen, started, config, new_tokens)


@dataclass
class Generation:
    """What ``generate`` keeps between calls on one ringified model: the model, its ring and
    layout, the ringified copy that prefills (``outputs="sharded"``: each rank keeps its part
    of the cache), the decode steps traced (by batch, inputs, cache shapes and modes), and the
    last call's cache."""

    model: nn.Module
    ring: Ring
    layout: str
    prefill: nn.Module
    steps: dict = field(default_factory=dict)
    cache: ShardedCache | None = None


@dataclass
class Prefilled:
    """What the prefill leaves for the decode: the last position's logits, the attention
    mask so far, this rank's cache part, and the decode step."""

    input_ids: torch.Tensor
    logits: torch.Tensor
    mask: torch.Tensor
    cache: ShardedCache
    step: DecodeStep
    takes_positions: bool


@torch.no_grad()
def prefill(gen: Generation, input_ids, attention_mask, new_tokens: int, pad_id: int) -> Prefilled:
    """Run the prompt through the ringified model, keeping this rank's part of the cache,
    with room for its share of ``new_tokens``."""
    model, ring, layout = gen.model, gen.ring, gen.layout
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    pad = -input_ids.shape[1] % split_multiple(ring.size, layout)
    ids = torch.nn.functional.pad(input_ids, (pad, 0), value=pad_id)
    mask = torch.nn.functional.pad(attention_mask, (pad, 0), value=0)
    takes = set(inspect.signature(model.forward).parameters)
    inputs = {"input_ids": ids, "attention_mask": mask}
    if "position_ids" in takes:
        inputs["position_ids"] = _positions(mask)
    keep_last = {"logits_to_keep": 1} if "logits_to_keep" in takes else {}
    from transformers import DynamicCache

    # an empty cache of full layers: a sliding-window layer's cache would keep only its
    # window, replicated; the full layers' parts are split like the sequence
    try:
        keyword = cache_keyword(model)
        if keyword is None:
            raise TypeError("its forward takes no KV cache argument")
        cache = {keyword: DynamicCache()}
        out = gen.prefill(**inputs, **keep_last, **cache, use_cache=True)
    except Exception as e:
        raise ValueError(
            f"ringify's generate could not prefill {type(model).__name__} with a DynamicCache "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). {SUPPORTED}; "
            "for another cache, prefill with the ringified model and continue with "
            "model.generate (README, 'Long prompts')."
        ) from e
    logits = out.logits[:, -1:] if keep_last else _last_logits(out.logits, gen)
    parts = [(layer.keys, layer.values) for layer in cache_of(out).layers]
    del out
    length = ids.shape[1]
    local = shard_for_rank(torch.arange(length, device=ids.device), 0, ring.rank, ring.size, layout)
    step = _decode_step(gen, inputs, parts)
    cache = ShardedCache(parts, local, ring, -(-new_tokens // ring.size) + 1, length)
    return Prefilled(input_ids, logits, mask, cache, step, "position_ids" in takes)


@torch.no_grad()
def decode(gen: Generation, started: Prefilled, config, new_tokens: int):
    """Choose ``new_tokens`` tokens, one decode step each after the first; HF's output."""
    ring, cache, mask, logits = gen.ring, started.cache, started.mask, started.logits
    eos = _token_ids(config.eos_token_id, mask.device)
    pad_id = _pad_id(config)
    sequences = started.input_ids
    unfinished = sequences.new_ones(sequences.shape[0])
    scores, raw = [], []
    for i in range(new_tokens):
        next_logits = logits[:, -1].to(torch.float32, copy=True)  # as HF: processed in fp32
        processed = _process(config, sequences, next_logits)
        scores.append(processed)
        raw.append(next_logits)
        token = _choose(config, processed, ring)
        token = token * unfinished + pad_id * (1 - unfinished)
        sequences = torch.cat([sequences, token[:, None]], 1)
        if eos is not None:
            unfinished = unfinished * ~torch.isin(token, eos)
        # a host read per token, as HF's stopping criteria make, only where an EOS can stop
        if i == new_tokens - 1 or (eos is not None and not unfinished.any()):
            break
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        inputs = {"input_ids": token[:, None], "attention_mask": mask}
        if started.takes_positions:
            inputs["position_ids"] = _positions(mask)[:, -1:]
        logits, new_keys, new_values = started.step(inputs, cache)
        cache.append(new_keys, new_values)
    gen.cache = cache
    if not config.return_dict_in_generate:
        return sequences
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=tuple(scores) if config.output_scores else None,
        logits=tuple(raw) if config.output_logits else None,
        **{cache_field(GenerateDecoderOnlyOutput): cache.as_dynamic_cache()},
    )


def _generation_config(model, kwargs: dict):
    base = kwargs.pop("generation_config", None) or getattr(model, "generation_config", None)
    if base is None:
        from transformers import GenerationConfig

        base = GenerationConfig()
    config = copy.deepcopy(base)
    unknown = config.update(**kwargs)
    refused = sorted(unknown) + [
        name
        for name, default in _UNSUPPORTED.items()
        if getattr(config, name, None) not in (None, default)
    ]
    if refused:
        raise ValueError(
            f"ringify's generate does not support {', '.join(refused)}; it supports {_SUPPORTED}"
        )
    return config


def _pad_id(config) -> int:
    """HF's: the pad token, else the first end-of-sequence token, else 0."""
    if config.pad_token_id is not None:
        return config.pad_token_id
    eos = config.eos_token_id
    return eos if isinstance(eos, int) else (next(iter(eos)) if eos else 0)


def _token_ids(ids, device) -> torch.Tensor | None:
    if ids is None:
        return None
    return torch.tensor([ids] if isinstance(ids, int) else list(ids), device=device)


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """HF's position ids of a left-padded batch: 0, 1, ... from each row's first token."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


def _process(config, sequences: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """HF's sampling warpers, in HF's order (none for greedy)."""
    if not config.do_sample:
        return logits
    from transformers.generation import logits_process as lp

    if config.temperature is not None and config.temperature != 1.0:
        logits = lp.TemperatureLogitsWarper(config.temperature)(sequences, logits)
    if config.top_k is not None and config.top_k != 0:
        logits = lp.TopKLogitsWarper(top_k=config.top_k)(sequences, logits)
    if config.top_p is not None and config.top_p < 1.0:
        logits = lp.TopPLogitsWarper(top_p=config.top_p)(sequences, logits)
    if config.min_p is not None:
        logits = lp.MinPLogitsWarper(min_p=config.min_p)(sequences, logits)
    return logits


def _choose(config, scores: torch.Tensor, ring) -> torch.Tensor:
    if not config.do_sample:
        return scores.argmax(-1)
    token = torch.multinomial(scores.softmax(-1), num_samples=1).squeeze(1)
    if ring.size > 1:  # ranks' generators may differ: the first rank's draw is everyone's
        dist.broadcast(token, src=ring.global_rank(0), group=ring.group)
    return token


def _decode_step(gen: Generation, inputs: dict, parts: list) -> DecodeStep:
    """The decode step for this batch, cache dtype and model modes (traced once for them)."""
    like = tuple((k.shape[:2], k.shape[3], k.dtype, k.device) for k, _ in parts)
    modes = tuple(m.training for m in gen.model.modules())
    key = (inputs["input_ids"].shape[0], tuple(sorted(inputs)), like, modes)
    steps = gen.steps
    if key not in steps:
        step_inputs = {k: x[:, -1:] if k != "attention_mask" else x for k, x in inputs.items()}
        steps[key] = DecodeStep(gen.model, gen.ring, step_inputs, parts)
    return steps[key]


def _last_logits(logits: torch.Tensor, gen: Generation) -> torch.Tensor:
    """The last position's logits from this rank's part (a model with no ``logits_to_keep``)."""
    from ringify.runtime.collectives.sharding import gather

    ring, layout = gen.ring, gen.layout
    return gather(logits, 1, group=ring.group, layout=layout)[:, -1:]
