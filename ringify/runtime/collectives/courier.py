"""The one seam through which the ring op's tensors travel between ranks.

Three things travel: K/V tiles round the ring (forward and backward), their dK/dV going
on with them and then home, and the query rows a balanced plan moves. Each is a
``Parcel``, whose value is its P2P tag: the tag keeps concurrent transfers apart on
gloo, which matches by tag; NCCL matches a pair's operations in issue order, which every
rank keeps (the ring's steps, and within a step the order of ``send`` and ``receive``).

A ``Courier`` collects one exchange's sends and named receives and ``start``s them as
one batch; its ``Delivery`` is waited for after the work it overlaps, and gives each
receive by its name (torch's ``_RingRotater`` hides its transport the same way, behind
``exchange_buffers`` and ``next_buffer``). The transport itself is ``collectives/p2p.py``.
"""

from __future__ import annotations

import enum

import torch

from ringify.runtime.collectives.p2p import buffers_like, start_exchange
from ringify.runtime.collectives.ring import Ring


class Parcel(enum.IntEnum):
    """What a transfer carries; the value is its tag."""

    KV = 0  # K/V tiles, to the next rank
    DKV = 1  # their gradients, on with the tiles, then home
    QUERY_ROWS = 2  # rows a balanced plan moves, and their results back


class Delivery:
    """A started exchange: ``wait()`` gives every receive by its name (its sends done too,
    so that their buffers may be reused)."""

    def __init__(self, pending, names: list[str]):
        self._pending, self._names = pending, names

    def wait(self) -> dict[str, list[torch.Tensor]]:
        return dict(zip(self._names, self._pending.wait(), strict=True))


class Courier:
    """One exchange of ``parcel`` on ``ring``: ``send`` and ``receive`` what it carries,
    then ``start`` it."""

    def __init__(self, ring: Ring, parcel: Parcel):
        self.ring, self.parcel = ring, parcel
        self._sends: list = []
        self._receives: list = []
        self._names: list[str] = []

    def send(self, peer: int, tensors: list[torch.Tensor]) -> Courier:
        self._sends.append((peer, tensors))
        return self

    def receive(
        self, name: str, peer: int, like: list[torch.Tensor], dtype: torch.dtype | None = None
    ) -> Courier:
        """Receive into new buffers shaped as ``like`` (in ``dtype``, else theirs)."""
        return self.receive_into(name, peer, buffers_like(like, dtype))

    def receive_into(self, name: str, peer: int, buffers: list[torch.Tensor]) -> Courier:
        """Receive into the given dense ``buffers``."""
        self._receives.append((peer, buffers))
        self._names.append(name)
        return self

    def start(self) -> Delivery | None:
        """Start what was sent and received, all at once (None if nothing was)."""
        if not (self._sends or self._receives):
            return None
        pending = start_exchange(self.ring, self._sends, self._receives, tag=int(self.parcel))
        return Delivery(pending, self._names)

    def peer(self, steps: int) -> int:
        """The rank ``steps`` on round the ring from this one (back where negative)."""
        return (self.ring.rank + steps) % self.ring.size
