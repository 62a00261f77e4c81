"""What runs on each rank: ring attention, sequence layouts, and the sequence gather.

- ``shard(x, dim, group=, layout=)``: this rank's part of a full tensor.
- ``gather(x, dim, group=, layout=)``: the full tensor from every rank's part.
- ``ring_attention(q, k, v, ...)``: exact SDPA over a sharded sequence
  (``torch.ops.ringify.ring_attention`` underneath); with ``dilation=`` LongNet's
  dilated attention (``torch.ops.ringify.dilated_attention``).
- ``dilated_attention(q, k, v, dilation=...)``: its single-device definition.
"""

import importlib
import sys

from ringify.runtime.attention import decode as _decode  # noqa: F401  (registers its op)
from ringify.runtime.attention.api import ring_attention
from ringify.runtime.attention.dilation import Dilation, dilated_attention
from ringify.runtime.collectives.sharding import gather, shard
from ringify.runtime.tiling.layout import LAYOUTS

__all__ = ["LAYOUTS", "Dilation", "dilated_attention", "gather", "ring_attention", "shard"]

# The modules of the flat runtime before it had rooms keep their import paths, as aliases of
# the modules themselves (so a tool that patches one patches what runs): tools outside the
# package import them, ../shared/gpu_probe among them.
_MOVED = {
    "ring_ops": "attention.ops",
    "block_attention": "attention.blocks",
    "flash_kernel": "attention.flash",
    "memory_attention": "attention.memory",
    "dilated_ops": "attention.dilated_ops",
    "dilation": "attention.dilation",
    "mask_program": "masks.program",
    "mask_bounds": "masks.bounds",
    "mask_program_grad": "masks.grads",
    "tile_masks": "masks.tile_masks",
    "attention_plan": "masks.plan",
    "layout": "tiling.layout",
    "tiles": "tiling.tiles",
    "schedule": "tiling.schedule",
    "balance": "tiling.balance",
    "tile_moves": "tiling.moves",
    "ring": "collectives.ring",
    "p2p": "collectives.p2p",
    "sharding": "collectives.sharding",
    "ring_reduce": "collectives.reduce",
    "ring_scan": "collectives.scan",
    "ring_shift": "collectives.shift",
    "agreement": "collectives.agreement",
}
for _old, _new in _MOVED.items():
    sys.modules[f"{__name__}.{_old}"] = importlib.import_module(f"{__name__}.{_new}")
