"""Which transport a sharded attention runs on, under the strategy ``ringify()`` was given.

``"ring"``: K/V tiles travel round the ring (P-1 steps of one K/V shard). ``"ulysses"``: an
all-to-all gives each rank every row of its share of the heads (DeepSpeed-Ulysses; (P-1)/P
of one shard each of q, K/V and the output), for each attention it can serve; the others
keep the ring, and the report says why. Both byte counts go into the report either way.
"""

from __future__ import annotations

import math

from ringify.passes.crossings import PassState
from ringify.passes.nodes import shape
from ringify.passes.placement import Seq
from ringify.runtime.collectives.heads import kv_repeats
from ringify.runtime.masks.plan import ALL_TO_ALL, RING
from ringify.runtime.masks.program import program_mask


def choose_transport(att, state: PassState) -> tuple[str, str]:
    """``(transport, why the ring was kept)`` of a sharded attention under the strategy asked
    for: the all-to-all where its heads divide by the ring (GQA's K/V repeated as far as
    needed) and its mask is the same for every head (a program or none)."""
    if state.strategy == "ring" or state.dilation is not None:
        return RING, ""
    u = getattr(state.strategy, "u", state.geo.ring_size)  # ``Hybrid``'s groups, or the ring
    heads, kv_heads = shape(att.q)[1], shape(att.k)[1]
    if kv_repeats(heads, kv_heads, u) is None:
        return RING, f"its {heads} heads do not divide by the all-to-all's {u} ranks"
    if att.mask is not None and att.mask.target is not program_mask:
        return RING, "its mask is a tensor of this rank's rows (not a program)"
    if att.mask is not None and len(shape(att.mask)) == 4 and shape(att.mask)[1] > 1:
        return RING, "its mask differs per head"
    return (ALL_TO_ALL if u == state.geo.ring_size else f"{ALL_TO_ALL}:{u}"), ""


def all_to_all_bytes(att, q, k, v, state: PassState) -> int:
    """Elements one rank sends in an all-to-all forward: (P-1)/P of its q, K/V (repeated as
    far as the ring needs) and output shards."""
    p, geo = state.geo.ring_size, state.geo
    heads, kv_heads = shape(att.q)[1], shape(att.k)[1]
    repeats = kv_repeats(heads, kv_heads, p) or 1
    local = [math.prod(geo.local_shape(shape(x), Seq(2))) for x in (q, k, v)]
    return (local[0] * 2 + (local[1] + local[2]) * repeats) * (p - 1) // p
