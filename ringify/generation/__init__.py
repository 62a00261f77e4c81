"""Generation on the ring: a prefill that keeps the KV cache split, then one decode step per token."""

from ringify.generation.loop import Generation, generate

__all__ = ["Generation", "generate"]
