"""The ring schedule: how a shard is tiled, which tiles a rank holds at each step, which pairs work.

The ring ops own the tiling decision (``shard_tiles``): positions matter only
under a causal mask, a mask or padding keys; otherwise any tiling will do and the
shard is tiled as one chunk. Every rank computes the same decision from the
same arguments, so the sub-rings line up.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from ringify.runtime.collectives.courier import Courier, Parcel
from ringify.runtime.collectives.ring import Ring
from ringify.runtime.tiling.moves import sequence_rows
from ringify.runtime.tiling.tiles import Tile, Tiling, rank_tiles, sub_ring_tiles, tiles_per_chunk


def needs_positions(masked: bool, is_causal: bool, key_len: int, total_rows: int) -> bool:
    """Whether the op needs each tile's global positions (else any tiling will do)."""
    return is_causal or masked or key_len < total_rows


def shard_tiles(
    rank: int, ring_size: int, rows: int, layout: str, positional: bool, per_chunk: int,
    device_type: str = "cpu",
):  # fmt: skip
    """Rank ``rank``'s tiles; ``per_chunk=0`` lets ``tiles_per_chunk`` choose (for the device)."""
    layout = layout if positional else "contiguous"
    per_chunk = per_chunk or tiles_per_chunk(rows, layout, device_type)
    return rank_tiles(rank, ring_size, rows, layout, per_chunk)


def ring_visits(ring: Ring, k, v, tiling, last_steps) -> Iterator[tuple]:
    """Walk every sub-ring round the ring: yields ``(own, step, src, held, kv)``.

    ``tiling(rank)`` gives a rank's tiles; ``last_steps(sub_ring)`` the last step at
    which each rank's tiles of that sub-ring are seen (``TileMasks.last_steps``): they
    travel no further. ``own``: this rank's ``SubRing``; ``held``: the tiles
    of rank ``src`` = (rank - step) held at this step, and ``kv`` their ``HeldKV`` (both
    None at a step where nothing is held). The sends of the next step start before
    yielding, so they are in flight while the caller computes.

    Tiles travel sequence-major, (rows, B, K, D), and arrive side by side in one buffer
    for K and one for V: the held tiles then join into one view (``HeldKV.keys``), and a
    tile passed on is sent as it arrived, without a copy.
    """
    for own in sub_rings(tiling, ring.rank):
        j, last = own.tiles[0].sub_ring, last_steps(own.tiles[0].sub_ring)
        kv = HeldKV(own, None, None, k, v)
        for step in range(ring.size):
            src, nxt = (ring.rank - step) % ring.size, (ring.rank - step - 1) % ring.size
            courier = Courier(ring, Parcel.KV)
            if step + 1 <= last[src]:
                courier.send(courier.peer(1), kv.wire())
            received = None
            if step + 1 <= last[nxt]:
                received = HeldKV(own, *(_sequence_major(x, own) for x in (k, v)))
                courier.receive_into("kv", courier.peer(-1), received.wire())
            delivery = courier.start()
            held = sub_ring(tiling, src, j).tiles if step <= last[src] else None
            yield own, step, src, held, kv if held is not None else None
            if delivery is not None:  # the sends are waited for too: their buffers outlive them
                delivery.wait()
            kv = received


class SubRing(NamedTuple):
    """A rank's tiles of one sub-ring, in local order: where each starts with the tiles side
    by side (and the last ends), and whether they are adjacent rows of the shard."""

    tiles: list[Tile]
    starts: list[int]
    adjacent: bool


@functools.lru_cache(maxsize=1024)  # asked in every call: the same few tilings each time
def sub_ring(tiling: Tiling, rank: int, j: int) -> SubRing:
    """Rank ``rank``'s tiles of sub-ring ``j`` under ``tiling``."""
    tiles = sub_ring_tiles(tiling(rank), j)
    adjacent = all(a.rows.stop == b.rows.start for a, b in itertools.pairwise(tiles))
    return SubRing(tiles, [0, *itertools.accumulate(t.length for t in tiles)], adjacent)


@functools.lru_cache(maxsize=1024)
def sub_rings(tiling: Tiling, rank: int) -> list[SubRing]:
    """Rank ``rank``'s tiles under ``tiling``, sub-ring by sub-ring."""
    return [sub_ring(tiling, rank, j) for j in sorted({t.sub_ring for t in tiling(rank)})]


class HeldKV(Sequence):
    """The K tiles, then the V tiles, held at a step: views (B, K, rows, D) made when first
    asked for. Tiles that lie side by side in memory (``joined``: received into one buffer,
    or own tiles of adjacent rows) give the keys of several tiles as one view (``keys``),
    and travel as one tensor each (``wire``)."""

    def __init__(self, own: SubRing, k_rows, v_rows, k=None, v=None):
        # received: (rows, B, K, D) buffers; own: k and v themselves (adjacent rows, or not)
        self._sub, self._rows, self._kv, self._views = own, (k_rows, v_rows), (k, v), {}
        self._own, self.starts = own.tiles, own.starts

    @property
    def joined(self) -> bool:
        return self._rows[0] is not None or self._sub.adjacent

    def __len__(self) -> int:
        return 2 * len(self._own)

    def __getitem__(self, i: int) -> torch.Tensor:
        if i not in self._views:
            n, tile = len(self._own), self._own[i % len(self._own)]
            if self._rows[0] is None:  # own: the tile's rows of k or v
                self._views[i] = self._kv[i // n].narrow(2, tile.rows.start, tile.length)
            else:
                self._views[i] = self._span(i // n, self.starts[i % n], tile.length)
        return self._views[i]

    def keys(self, first: int, tiles: int, cols: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at key rows ``cols`` of held tile ``first`` (running on into the ``tiles``
        after it, side by side, where ``tiles`` > 1): the tile itself when that is all of it."""
        length = cols.stop - cols.start
        if tiles > 1:
            start = self.starts[first] + cols.start
            return self._span(0, start, length), self._span(1, start, length)
        k, v = self[first], self[len(self._own) + first]
        if cols.start == 0 and length == k.shape[2]:
            return k, v
        return k.narrow(2, cols.start, length), v.narrow(2, cols.start, length)

    def sequences(self, first: int, tiles: int, cols: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at the keys ``keys`` gives, as FA2's varlen (keys, K, D) views of a batch of
        one: one view op each, from the received buffers or from k and v themselves."""
        length = cols.stop - cols.start
        if self._rows[0] is not None:  # received side by side, sequence-major
            k, v, start, rows_dim = *self._rows, self.starts[first] + cols.start, 0
        else:  # own tiles (several only where adjacent): rows of k and v
            k, v, start, rows_dim = *self._kv, self._own[first].rows.start + cols.start, 2
        return sequence_rows(k, start, length, rows_dim), sequence_rows(v, start, length, rows_dim)

    def _span(self, which: int, start: int, length: int) -> torch.Tensor:
        """K (0) or V (1) at held rows ``start`` on, (B, K, rows, D): each view op costs a
        GPU's host a dispatch, so a span is one view (a span of own rows, a narrow; of a
        received buffer, one ``as_strided``, not a permute and a narrow), and a span of all
        the rows of own tiles is the tensor itself."""
        buffer = self._rows[which]
        if buffer is None:  # own adjacent tiles: rows of k and v themselves
            x, start = self._kv[which], self._own[0].rows.start + start
            return x if start == 0 and length == x.shape[2] else x.narrow(2, start, length)
        rows, b, heads, d = buffer.shape  # sequence-major: (rows, B, K, D)
        if start == 0 and length == rows:  # the whole buffer, made once
            if ("all", which) not in self._views:
                self._views["all", which] = buffer.permute(1, 2, 0, 3)
            return self._views["all", which]
        stride = buffer.stride()
        return buffer.as_strided(
            (b, heads, length, d),
            (stride[1], stride[2], stride[0], stride[3]),
            buffer.storage_offset() + start * stride[0],
        )

    def wire(self) -> list[torch.Tensor]:
        """What travels: K then V, sequence-major: one tensor each where the sub-ring's tiles
        are adjacent rows (so on every rank), else one per tile (received side by side)."""
        if self._rows[0] is not None:  # received: sent on as they arrived
            if self._sub.adjacent:
                return list(self._rows)
            return [x[a:b] for x in self._rows for a, b in itertools.pairwise(self.starts)]
        if self._sub.adjacent:
            return [self._span(x, 0, self.starts[-1]).permute(2, 0, 1, 3) for x in (0, 1)]
        return [self[i].permute(2, 0, 1, 3) for i in range(len(self))]


def _sequence_major(x: torch.Tensor, own: SubRing) -> torch.Tensor:
    """A receive buffer (rows, B, K, D) for the sub-ring's tiles of ``x``, side by side."""
    b, heads, _, d = x.shape
    return torch.empty(own.starts[-1], b, heads, d, dtype=x.dtype, device=x.device)
