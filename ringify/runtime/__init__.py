"""What runs on each rank: ring attention, sequence layouts, and the sequence gather.

- ``shard(x, dim, group=, layout=)``: this rank's part of a full tensor.
- ``gather(x, dim, group=, layout=)``: the full tensor from every rank's part.
- ``ring_attention(q, k, v, ...)``: exact SDPA over a sharded sequence
  (``torch.ops.ringify.ring_attention`` underneath); with ``dilation=`` LongNet's
  dilated attention (``torch.ops.ringify.dilated_attention``).
- ``dilated_attention(q, k, v, dilation=...)``: its single-device definition.
"""

from ringify.runtime.attention import memory_attention as _memory  # noqa: F401  (registers decode_attention)
from ringify.runtime.attention.api import ring_attention
from ringify.runtime.attention.dilation import Dilation
from ringify.runtime.attention.reference import dilated_attention
from ringify.runtime.collectives.layout import LAYOUTS
from ringify.runtime.collectives.sharding import gather, shard

__all__ = ["LAYOUTS", "Dilation", "dilated_attention", "gather", "ring_attention", "shard"]
