"""HF KV caches in a ringified call: left out in training, returned in eval.

HF decoders default to ``use_cache=True`` and return a ``DynamicCache``, which
``torch.export`` cannot flatten unless it is registered as a pytree node.

- In training nothing reads the cache, and gathering every layer's K/V onto every rank
  would spend the memory the ring saves: the call runs with ``use_cache=False`` (as HF
  does under gradient checkpointing), and says so once.
- In eval, HF's own ``register_dynamic_cache_export_support`` makes ``DynamicCache`` a
  pytree node: its K/V are outputs like any other, gathered with ``outputs="full"``
  or this rank's part with ``outputs="sharded"``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging

from torch import nn

log = logging.getLogger("ringify")


def cache_kwargs(model: nn.Module, kwargs: dict, takes_use_cache: bool, warned: set) -> dict:
    """``kwargs`` for this call: ``use_cache=False`` in training where the model would build
    a cache; in eval, the cache made exportable. ``takes_use_cache``: whether the model's
    forward has that parameter (read once); ``warned`` remembers the warning."""
    if not takes_use_cache:
        return kwargs
    wants = kwargs.get("use_cache")
    wants = getattr(getattr(model, "config", None), "use_cache", False) if wants is None else wants
    if not wants:
        return kwargs
    if model.training:
        if "use_cache" not in warned:
            warned.add("use_cache")
            log.warning(
                "ringify: use_cache=True ignored in training: the call runs with "
                "use_cache=False and returns no past_key_values (nothing trains on a cache, "
                "and gathering it would cost every layer's K/V on every rank). Pass "
                "use_cache=False, or set model.config.use_cache = False, to silence this."
            )
        return kwargs | {"use_cache": False}
    exportable_dynamic_cache()
    return kwargs


# The names HF has given a decoder's KV cache, newest first: transformers 5.24 renamed
# ``past_key_values`` (in forward's arguments and in its outputs) to ``cache``.
_CACHE_NAMES = ("cache", "past_key_values")


def cache_keyword(model: nn.Module) -> str | None:
    """The keyword the model's forward takes its KV cache by, read from its signature (so
    that a rename is followed, not guessed); ``None`` where it takes none."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((name for name in _CACHE_NAMES if name in parameters), None)


def cache_field(output_type: type) -> str:
    """The field an HF output class (``CausalLMOutputWithPast``, ``GenerateDecoderOnlyOutput``)
    holds the KV cache in."""
    fields = {f.name for f in dataclasses.fields(output_type)}
    found = next((name for name in _CACHE_NAMES if name in fields), None)
    if found is None:
        raise ValueError(f"{output_type.__name__} has no KV cache field ({_CACHE_NAMES})")
    return found


def cache_of(output):
    """The KV cache an HF model's output returns (``None`` where it returns none)."""
    return getattr(output, cache_field(type(output)))


@functools.cache
def exportable_dynamic_cache() -> None:
    try:
        from transformers.integrations.executorch import register_dynamic_cache_export_support
    except ImportError:  # not an HF model: its own cache, if any, is export's to judge
        return
    register_dynamic_cache_export_support()


def cache_hint(message: str) -> str:
    """What to do when export failed (``message``: its errors' texts) on a cache ringify
    cannot return; "" otherwise."""
    if "DynamicCache containing only" in message or ("Cache" in message and "in output" in message):
        return (
            " Here: the model returns a KV cache ringify cannot return. ringify returns HF's "
            "DynamicCache of attention layers (full or sliding window); other caches (a "
            "hybrid's Mamba state, a static cache) are not supported: pass use_cache=False."
        )
    return ""
