"""ringify: sequence parallelism for an unmodified PyTorch model.

In place today: ``ringify.runtime`` — ``ring_attention`` (exact SDPA over a
sequence sharded across a ring of ranks, a ``torch.library`` custom op),
``shard`` and ``gather``. The graph pass ``ringify(model, ring_size=...)`` that
applies it to a whole model comes next (``../shared/DESIGN.md``).
"""

from ringify import runtime

__all__ = ["runtime"]
