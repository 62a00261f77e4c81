"""The all-to-all between a sequence shard and a head shard (DeepSpeed-Ulysses' exchange).

``to_heads(x, ring)``: this rank's rows of every head, (B, H, S/P, D), becomes every row of
this rank's heads, (B, H/P, S, D): rank r keeps heads [r H/P, (r+1) H/P), and the rows
arrive in rank order, each rank's in its local order (under ``zigzag`` the sequence is so
permuted; the caller's tiles say where each row sits). ``to_sequence`` is its inverse.
Per rank each moves (P-1)/P of the tensor, in one ``all_to_all_single``; the P2P ring moves
K and V P-1 times. Heads must divide by the ring: ``kv_repeats`` says how far K/V heads (GQA)
are repeated first so that they do, and every query head keeps its own K/V head.

``Transport`` names which of the two a call runs on, from the pass's choice to the plan op,
the op's loop (``attention/transport.py``) and the report: one value, printed here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._library.opaque_object import get_opaque_type_name, register_opaque_type

from ringify.runtime.collectives.ring import Ring, count_sent


@dataclass(frozen=True)
class Transport:
    """How a call's K/V reach its queries on a ring of ``size`` ranks: an all-to-all onto
    heads inside groups of ``heads_group`` consecutive ranks (1: none, K/V travel round the
    P2P ring; ``size``: DeepSpeed-Ulysses over the whole ring; between: USP's hybrid, the K/V
    then travelling round the ring of the size / heads_group groups). A ``torch.library``
    opaque value: the plan op takes it, and a graph holds it as a constant."""

    size: int
    heads_group: int = 1

    def __post_init__(self) -> None:
        if self.heads_group < 1 or self.size % self.heads_group:
            raise ValueError(
                f"an all-to-all over groups of {self.heads_group} ranks needs groups that "
                f"divide the ring of {self.size}"
            )

    @classmethod
    def ulysses(cls, size: int) -> Transport:
        return cls(size, size)

    @property
    def is_ring(self) -> bool:
        return self.heads_group == 1

    @property
    def groups(self) -> int:
        """The ranks of the ring the K/V travel round: the groups of ``heads_group``."""
        return self.size // self.heads_group

    def __str__(self) -> str:
        if self.is_ring:
            return f"ring of {self.size}"
        if self.groups == 1:
            return f"all-to-all over {self.size} (Ulysses)"
        return f"all-to-all in groups of {self.heads_group}, ring of {self.groups} groups (hybrid)"

    def __fx_repr__(self) -> tuple[str, dict[str, type]]:
        return repr(self), {"Transport": Transport}


register_opaque_type(Transport, typ="value")
TRANSPORT_TYPE = get_opaque_type_name(Transport)  # its name in an op's schema


def to_heads(x: torch.Tensor, ring: Ring) -> torch.Tensor:
    """(B, H, s, ...) on each rank -> (B, H / P, P s, ...): this rank's heads, every row."""
    if ring.size == 1:
        return x
    b, h, s, *rest = x.shape
    p = ring.size
    # (P, B, H/P, s, ...): the part for rank g first, so that it is one contiguous block
    parts = x.reshape(b, p, h // p, s, *rest).transpose(0, 1).contiguous()
    received = exchanged(parts, ring)
    # received[g]: rank g's rows of this rank's heads -> rows in rank order
    return received.permute(1, 2, 0, 3, *range(4, parts.dim())).reshape(b, h // p, p * s, *rest)


def to_sequence(x: torch.Tensor, ring: Ring) -> torch.Tensor:
    """``to_heads``' inverse: (B, H / P, P s, ...) -> (B, H, s, ...)."""
    if ring.size == 1:
        return x
    b, hp, rows, *rest = x.shape
    p, s = ring.size, rows // ring.size
    # (P, B, H/P, s, ...): rank g's rows of this rank's heads
    parts = x.reshape(b, hp, p, s, *rest).permute(2, 0, 1, 3, *range(4, x.dim() + 1))
    received = exchanged(parts.contiguous(), ring)
    # received[g]: this rank's rows of rank g's heads -> heads in rank order
    return received.transpose(0, 1).reshape(b, p * hp, s, *rest)


def exchanged(parts: torch.Tensor, ring: Ring) -> torch.Tensor:
    """``parts[g]`` sent to rank g; what each rank sent this one, in rank order."""
    received = torch.empty_like(parts)
    dist.all_to_all_single(received, parts, group=ring.group)
    count_sent(parts.numel() * parts.element_size() * (ring.size - 1) // ring.size)
    return received


def kv_repeats(heads: int, kv_heads: int, ring_size: int) -> int | None:
    """How many times each K/V head is repeated so that the ring divides them and they still
    divide the query heads (GQA, as USP repeats them): 1 where the ring divides them already;
    None where no repeat serves (the ring does not divide the query heads)."""
    if heads % ring_size:
        return None
    repeats = ring_size // math.gcd(kv_heads, ring_size)
    return repeats if heads % (kv_heads * repeats) == 0 else None
