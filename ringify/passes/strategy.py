"""Which transport a sharded attention runs on, under the strategy ``ringify()`` was given.

``"ring"``: K/V tiles travel round the ring (P-1 steps of one K/V shard). ``"ulysses"``: an
all-to-all gives each rank every row of its share of the heads (DeepSpeed-Ulysses; (P-1)/P
of one shard each of q, K/V and the output), for each attention it can serve; ``Hybrid(u)``,
the all-to-all inside groups of u ranks and K/V round the groups; ``"auto"``, chosen per
attention from its heads, the bytes and which ranks share a host. The attentions none
serves keep the ring, and the report says why. Both byte counts go into the report.
"""

from __future__ import annotations

import math

from ringify.config import Auto
from ringify.passes.crossings import PassState
from ringify.passes.nodes import shape
from ringify.passes.placement import Seq
from ringify.runtime.collectives.heads import kv_repeats
from ringify.runtime.masks.plan import ALL_TO_ALL, RING
from ringify.runtime.masks.program import program_mask


def choose_transport(att, state: PassState) -> tuple[str, str]:
    """``(transport, why the ring was kept)`` of a sharded attention under the strategy asked
    for: the all-to-all where its heads divide by the ranks it spans (GQA's K/V repeated as
    far as needed) and its mask is the same for every head (a program or none). ``"auto"``:
    inside a host, the all-to-all where it moves fewer bytes than the ring; over hosts of
    equal blocks of ranks, the hybrid with the all-to-all inside each host."""
    strategy, size = state.strategy, state.geo.ring_size
    if strategy == "ring" or state.dilation is not None:
        return RING, ""
    u = size if strategy == "ulysses" else getattr(strategy, "u", 0)
    if isinstance(strategy, Auto):
        u = strategy.per_host if 1 < strategy.per_host < size else size
        if strategy.per_host == 1 and size > 1:
            return RING, "its ranks are not in equal blocks per host: the ring"
    heads, kv_heads = shape(att.q)[1], shape(att.k)[1]
    if kv_repeats(heads, kv_heads, u) is None:
        return RING, f"its {heads} heads do not divide by the all-to-all's {u} ranks"
    if att.mask is not None and att.mask.target is not program_mask:
        return RING, "its mask is a tensor of this rank's rows (not a program)"
    if att.mask is not None and len(shape(att.mask)) == 4 and shape(att.mask)[1] > 1:
        return RING, "its mask differs per head"
    if isinstance(strategy, Auto) and u == size:
        ring = ring_bytes(att, state)
        heads_bytes = all_to_all_bytes(att, att.q, att.k, att.v, state)
        if heads_bytes >= ring:
            return RING, f"the ring moves fewer bytes ({ring} against {heads_bytes} elements)"
    return (ALL_TO_ALL if u == size else f"{ALL_TO_ALL}:{u}"), ""


def ring_bytes(att, state: PassState) -> int:
    """Elements one rank sends round the ring in a forward: its K/V shards, P-1 times."""
    geo = state.geo
    local = [math.prod(geo.local_shape(shape(x), Seq(2))) for x in (att.k, att.v)]
    return sum(local) * (geo.ring_size - 1)


def all_to_all_bytes(att, q, k, v, state: PassState) -> int:
    """Elements one rank sends in an all-to-all forward: (P-1)/P of its q, K/V (repeated as
    far as the ring needs) and output shards."""
    p, geo = state.geo.ring_size, state.geo
    heads, kv_heads = shape(att.q)[1], shape(att.k)[1]
    repeats = kv_repeats(heads, kv_heads, p) or 1
    local = [math.prod(geo.local_shape(shape(x), Seq(2))) for x in (q, k, v)]
    return (local[0] * 2 + (local[1] + local[2]) * repeats) * (p - 1) // p
