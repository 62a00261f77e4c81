"""Which transport a sharded attention runs on, under the strategy ``ringify()`` was given.

``"ring"``: K/V tiles travel round the ring (P-1 steps of one K/V shard). ``"ulysses"``: an
all-to-all gives each rank every row of its share of the heads (DeepSpeed-Ulysses; (P-1)/P
of one shard each of q, K/V and the output), for each attention it can serve; ``Hybrid(u)``,
the all-to-all inside groups of u ranks and K/V round the groups; ``"auto"``, chosen per
attention by the paper model of ``runtime/collectives/transport_costs.py`` from its shape, the ring's size
and which ranks share a host (the ring on CPU ranks, where gloo's all-to-all is no faster).
The attentions none serves keep the ring, and the report says why. Both byte counts go into
the report.
"""

from __future__ import annotations

import math

import torch

from ringify.config import Auto
from ringify.passes.graph.crossings import PassState
from ringify.passes.graph.nodes import shape, val
from ringify.passes.graph.placement import Seq
from ringify.runtime.attention.protocol import accumulation_dtype
from ringify.runtime.collectives.heads import Transport, kv_repeats
from ringify.runtime.collectives.transport_costs import Shape, fastest, sent_bytes
from ringify.runtime.masks.program import parse, program_mask


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


def choose_transport(att, state: PassState) -> tuple[Transport, str]:
    """``(transport, why the ring was kept)`` of a sharded attention under the strategy asked
    for: the all-to-all where its heads divide by the ranks it spans (GQA's K/V repeated as
    far as needed) and its mask is a program or none (one per head too: each rank evaluates
    its share of the heads). ``"auto"``: the transport the paper model makes fastest on GPUs;
    the ring on CPU ranks."""
    strategy, ring = state.strategy, Transport(state.geo.ring_size)
    if strategy in (None, ring) or state.dilation is not None or ring.size == 1:
        return ring, ""
    picked = strategy
    if isinstance(strategy, Auto):
        picked, note = auto_transport(attention_shape(att, state), val(att.q).device, strategy)
        if picked.is_ring:
            return ring, note
    heads, kv_heads, u = shape(att.q)[1], shape(att.k)[1], picked.heads_group
    if kv_repeats(heads, kv_heads, u) is None:
        return ring, f"its {heads} heads do not divide by the all-to-all's {u} ranks"
    if att.mask is not None and att.mask.target is not program_mask:
        return ring, "its mask is a tensor of this rank's rows (not a program)"
    return picked, ""


def auto_transport(shape: Shape, device: torch.device, auto: Auto) -> tuple[Transport, str]:
    """``strategy="auto"``: ``(transport, why the ring)`` for an attention of this shape on
    ``device``: what the paper model makes fastest on a GPU cluster of the ring's hosts; the
    ring on CPU ranks, where gloo's all-to-all ran no faster beyond the machine's noise and
    held 1.4-1.5 times the ring's memory (``benchmarks/RESULTS.md``, 8K-32K)."""
    if device.type == "cpu":
        note = "auto: the ring on CPU ranks (gloo's all-to-all is no faster, and holds more)"
        return Transport(auto.ring.size), note
    picked = fastest(shape, auto.ring.size, auto.per_host(device))
    return picked, "auto: the ring is modelled fastest" if picked.is_ring else ""


def attention_shape(att, state: PassState) -> Shape:
    """The attention as one rank holds it on the sequence, for the paper model: a training
    step where the graph has parameters that require a gradient."""
    geo = state.geo
    q_e, k_e, v_e = (math.prod(geo.local_shape(shape(x), Seq(2))) for x in (att.q, att.k, att.v))
    # a program that reads positions (causal, a window, documents) skips about half the
    # blocks or more; one that does not (padding) skips few: counted dense
    causal = att.is_causal or (
        att.mask is not None and att.mask.target is program_mask and _reads_positions(att.mask)
    )
    return Shape(
        q=q_e,
        kv=k_e + v_e,
        rows=q_e // shape(att.q)[-1],  # lse: one per query row and head
        heads=shape(att.q)[1],
        kv_heads=shape(att.k)[1],
        keys=shape(att.k)[2],
        element=val(att.q).element_size(),
        accumulator=accumulation_dtype(val(att.q).dtype).itemsize,
        causal=causal,
        trained=_trained(state),
    )


def _reads_positions(mask) -> bool:
    """Whether a mask program reads the queries' or keys' positions."""
    code = parse(mask.args[0]).code
    return any(isinstance(a, dict) and "pos" in a for _, args, _ in code for a in args)


def step_bytes(att, state: PassState) -> tuple[int, int]:
    """Bytes one rank sends in a step, ``(ring, all-to-all)`` (``transport_costs.sent_bytes``):
    the forward, and the backward in training."""
    return sent_bytes(attention_shape(att, state), state.geo.ring_size)
