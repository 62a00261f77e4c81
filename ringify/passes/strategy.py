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
from ringify.passes.nodes import shape, val
from ringify.passes.placement import Seq
from ringify.runtime.attention.outputs import accumulation_dtype
from ringify.runtime.collectives.heads import kv_repeats
from ringify.runtime.masks.plan import ALL_TO_ALL, RING
from ringify.runtime.masks.program import program_mask


def _trained(state: PassState) -> bool:
    """Whether the graph reads a tensor that requires a gradient (export's activations carry
    no such flag; its parameters and inputs do): one answer per graph."""
    if ("trained",) not in state._cache:
        state._cache["trained",] = any(
            getattr(n.meta.get("val"), "requires_grad", False)
            for n in state.graph.nodes
            if n.op in ("placeholder", "get_attr")
        )
    return state._cache["trained",]


def choose_transport(att, state: PassState) -> tuple[str, str]:
    """``(transport, why the ring was kept)`` of a sharded attention under the strategy asked
    for: the all-to-all where its heads divide by the ranks it spans (GQA's K/V repeated as
    far as needed) and its mask is the same for every head (a program or none). ``"auto"``:
    inside a host, the all-to-all where it sends fewer bytes a step than the ring; over hosts of
    equal blocks of ranks, the hybrid with the all-to-all inside each host."""
    strategy, size = state.strategy, state.geo.ring_size
    if strategy == "ring" or state.dilation is not None or size == 1:
        return RING, ""
    u = size if strategy == "ulysses" else getattr(strategy, "u", 0)
    if isinstance(strategy, Auto):
        if strategy.per_host == 1:
            return RING, "its ranks are not in equal blocks per host: the ring"
        u = strategy.per_host  # the whole ring where it shares one host
    heads, kv_heads = shape(att.q)[1], shape(att.k)[1]
    if kv_repeats(heads, kv_heads, u) is None:
        return RING, f"its {heads} heads do not divide by the all-to-all's {u} ranks"
    if att.mask is not None and att.mask.target is not program_mask:
        return RING, "its mask is a tensor of this rank's rows (not a program)"
    if att.mask is not None and len(shape(att.mask)) == 4 and shape(att.mask)[1] > 1:
        return RING, "its mask differs per head"
    if isinstance(strategy, Auto) and u == size:
        ring, heads_bytes = step_bytes(att, state)
        if heads_bytes >= ring:
            return RING, f"the ring sends fewer bytes a step ({ring} against {heads_bytes})"
    return (ALL_TO_ALL if u == size else f"{ALL_TO_ALL}:{u}"), ""


def step_bytes(att, state: PassState) -> tuple[int, int]:
    """Bytes one rank sends in a step, ``(ring, all-to-all)``: the forward, and the backward
    where the graph has parameters that require a gradient (a model in training). The ring:
    K/V shards P-1 times each way, dK/dV (in the accumulation dtype) P times, on and home (a
    dense mask: every tile to the last step). The all-to-all: (P-1)/P of q, K/V (repeated as
    far as it needs), out and lse forward; of dout, q, out, lse, K/V in and dq, dK, dV home
    backward."""
    p, geo = state.geo.ring_size, state.geo
    e = val(att.q).element_size()
    acc = accumulation_dtype(val(att.q).dtype).itemsize
    q_e, k_e, v_e = (math.prod(geo.local_shape(shape(x), Seq(2))) for x in (att.q, att.k, att.v))
    kv_e, rows = k_e + v_e, q_e // shape(att.q)[-1]  # lse: one per query row and head
    repeats = kv_repeats(shape(att.q)[1], shape(att.k)[1], p) or 1
    ring = (p - 1) * kv_e * e
    heads = (2 * q_e + kv_e * repeats) * e + rows * acc
    if _trained(state):
        ring += (p - 1) * kv_e * e + p * kv_e * acc
        heads += (4 * q_e + 2 * kv_e * repeats) * e + rows * acc
    return ring, heads * (p - 1) // p
