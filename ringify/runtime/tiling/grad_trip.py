"""The dK/dV of a sub-ring's K/V tiles on their trip round the ring, and home.

In the backward, K/V tiles travel round the ring again (``schedule.ring_visits``). The
gradient of each tile travels with it: every rank that holds the tile adds its queries'
share and passes the sum on; at the tile's last step (the farthest rank whose queries see
it) the sum goes straight home. ``GradTrip`` is that protocol for one sub-ring, step by
step: ``arrived`` waits for the exchange of the step before (storing what came home) and
gives what travels in, ``go_on`` sends this rank's sum on or home and posts the receives of
the next step, so that an exchange is in flight while the next tiles' blocks run.
"""

from __future__ import annotations

import torch

from ringify.runtime.collectives.courier import Courier, Delivery, Parcel
from ringify.runtime.collectives.ring import Ring
from ringify.runtime.tiling.schedule import SubRing


class GradTrip:
    """The trip of one sub-ring's dK/dV on ``ring``: this rank's tiles ``own``, which each
    rank's tiles travel as far as step ``last[rank]``; ``dk`` and ``dv`` (``RowSum``) take
    this rank's own tiles' sums when they arrive home, in ``acc``."""

    def __init__(self, ring: Ring, own: SubRing, last: list[int], k, v, dk, dv, acc) -> None:
        self.ring, self.last, self.slots = ring, last, GradSlots(own, k, v)
        self._dk, self._dv, self._acc = dk, dv, acc
        self._delivery: Delivery | None = None

    def arrived(self, step: int) -> list[torch.Tensor] | None:
        """The dK/dV travelling in at ``step`` (None at step 0, or where none comes), once
        the step before's exchange is done; what it brought home is stored."""
        arrived = self._wait()
        return arrived.get("travel") if step > 0 else None

    def go_on(self, step: int, src: int, dkv: list[torch.Tensor] | None) -> None:
        """Pass on ``dkv``, the sum for the tiles of rank ``src`` held at ``step`` (None where
        none are held): to the next rank, or home at their last step; and receive what the
        next step brings. The trip's last step waits for its exchange."""
        ring, last = self.ring, self.last
        if dkv is not None and step == last[src] == 0:  # seen only at home
            self.slots.store_home(dkv, self._dk, self._dv)
        courier = Courier(ring, Parcel.DKV)
        if dkv is not None and step < last[src]:
            courier.send(courier.peer(1), dkv)
        elif dkv is not None and step == last[src] > 0:
            courier.send(src, dkv)
        if step + 1 <= last[courier.peer(-step - 1)]:
            courier.receive_into("travel", courier.peer(-1), self.slots.buffers(self._acc))
        if step == last[ring.rank] > 0:
            courier.receive_into("home", courier.peer(step), self.slots.buffers(self._acc))
        self._delivery = courier.start()
        if step == ring.size - 1:  # the trip ends here
            self._wait()

    def _wait(self) -> dict[str, list[torch.Tensor]]:
        arrived = self._delivery.wait() if self._delivery is not None else {}
        self._delivery = None
        if "home" in arrived:
            self.slots.store_home(arrived["home"], self._dk, self._dv)
        return arrived


class GradSlots:
    """Where the dK/dV of a sub-ring's tiles accumulate, and so how they travel: one slot for
    K and one for V, every tile side by side, where the tiles are adjacent rows (as K/V then
    travel, on every rank); else one slot per tile, K tiles then V tiles."""

    def __init__(self, own: SubRing, k, v):
        self.joined, self._own, self._kv = own.adjacent, own.tiles, (k, v)
        self.starts = own.starts
        rows = [self.starts[-1]] if self.joined else [t.length for t in self._own]
        self.shapes = [(*x.shape[:2], r, x.shape[3]) for x in (k, v) for r in rows]

    def at(self, which: int, tile: int, cols: slice) -> tuple[int, slice]:
        """The slot and its key rows of K (0) or V (1) at ``cols`` of held tile ``tile``'s keys
        (``cols`` may run on into the tiles after it, where they are side by side)."""
        if not self.joined:
            return which * len(self._own) + tile, cols
        start = self.starts[tile]
        return which, slice(start + cols.start, start + cols.stop)

    def parts(self, which: int, b) -> list[tuple[int, slice, slice | None]]:
        """``(slot, its key rows, the block's key rows or None for all)`` for K (0) or V (1)
        of block ``b``: one slot where the tiles are joined, else one per tile the block's
        keys reach (side by side, they may start inside the first and stop inside the last)."""
        if self.joined or b.tiles == 1:
            return [(*self.at(which, b.held, b.cols), None)]
        first = self.starts[b.held] + b.cols.start
        end = self.starts[b.held] + b.cols.stop
        parts = []
        for t in range(b.held, b.held + b.tiles):
            lo, hi = max(first, self.starts[t]), min(end, self.starts[t + 1])
            if lo < hi:
                slot, rows = self.at(which, t, slice(lo - self.starts[t], hi - self.starts[t]))
                parts.append((slot, rows, slice(lo - first, hi - first)))
        return parts

    def buffers(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """New dense receive buffers, one per slot."""
        device = self._kv[0].device
        return [torch.empty(shape, dtype=dtype, device=device) for shape in self.shapes]

    def store_home(self, totals: list[torch.Tensor], dk, dv) -> None:
        """This rank's own tiles' dK and dV, complete (``totals``, one per slot): added into
        ``dk`` and ``dv`` (``attention/accumulator.py``'s ``RowSum``: each row arrives once)."""
        if self.joined:
            rows = slice(self._own[0].rows.start, self._own[0].rows.start + self.starts[-1])
            dk.add(rows, totals[0])
            dv.add(rows, totals[1])
            return
        n = len(self._own)
        for t, dk_home, dv_home in zip(self._own, totals[:n], totals[n:], strict=True):
            dk.add(t.rows, dk_home)
            dv.add(t.rows, dv_home)
