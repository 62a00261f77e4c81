"""Tiles: the unit of work and of communication of the ring.

Each chunk a rank holds (one for ``contiguous``, two for ``zigzag``) is cut into
the same ``tiles_per_chunk`` row ranges on every rank, so every tile is a
contiguous range of global positions and all tiles lie on one global grid,
ordered by ``(chunk index, tile index)``. Under a causal mask a (query tile,
key tile) pair is therefore either entirely visible, exactly the diagonal
(``is_causal`` aligned top-left), or entirely masked and skipped: no
partial masks, for either layout.

K/V travel in *sub-rings*: sub-ring t carries tile t of every chunk of the
shard. For ``zigzag`` that is one head tile and one tail tile, whose causal
work is complementary, so every rank does the same work at every step of every
sub-ring, as whole zigzag blocks do. (Travelling separately, head tiles give one
rank twice the other's work and tail tiles the reverse: 1.24x slower measured.)

Working tile by tile keeps the ring's buffers (K/V in flight, one block's
output or gradients) at O(rows / tiles) instead of O(rows).

The ring schedule: how a shard is tiled, which tiles a rank holds at each step, which pairs work.

The ring ops own the tiling decision (``shard_tiles``): positions matter only
under a causal mask, a mask or padding keys; otherwise any tiling will do and the
shard is tiled as one chunk. Every rank computes the same decision from the
same arguments, so the sub-rings line up.
"""

from __future__ import annotations

import enum
import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ringify.runtime.collectives.layout import chunks_per_rank, rank_chunks
from ringify.runtime.collectives.ring import Courier, Parcel, Ring

# Each tile pair is one kernel call plus one merge, ~1-3 ms of fixed cost on CPU:
# tiles under 1024 rows multiply the pairs per step beyond what the smaller
# buffers are worth. At 2 ranks, 512-row tiles ran 1.2-1.7x slower than
# 1024-row ones for 1.1x instead of 1.25-1.4x memory (the history of
# benchmarks/RESULTS.md).
# The finest grain of a tile, and of the blocks a mask's bounds are evaluated in.
MIN_TILE_ROWS = 1024
# The CPU cuts a chunk into tiles of at least this many rows: at 8K on 2 ranks,
# 1024-row tiles ran 4-9% slower than PyTorch's ring, 2048-row ones up to 5% slower or
# level, for 1.0-1.15x their memory, still 0.5-0.7x PyTorch's (the history of
# benchmarks/RESULTS.md).
CPU_TILE_ROWS = 2048
# On an accelerator a tile pair costs the host about the same ~10 launches (~50 µs) at any
# size, and an H100 runs a 1024 x 1024 block at Llama-8B's heads in ~60 µs forward: at
# 1024 rows the host would set the pace. There a chunk is cut into as few tiles as keep
# each under DEVICE_MAX_TILE_ROWS (K/V in flight and a pair's outputs stay tens of MiB,
# small beside the model's own activations), and a tile has at least DEVICE_TILE_ROWS.
DEVICE_TILE_ROWS = 4096
DEVICE_MAX_TILE_ROWS = 16384
# Tiles per chunk above which the buffers no longer shrink meaningfully.
MAX_TILES_PER_CHUNK = 8
# ... unless each query sees a short span of keys (a sliding window, short documents):
# then tiles about that span long let the ring skip the rest.
MAX_BANDED_TILES_PER_CHUNK = 64


@dataclass(frozen=True)
class Tile:
    rows: slice  # local rows of the shard
    key: tuple[int, int]  # (global chunk, tile within chunk): orders tiles by global position
    start: int  # global position of the first row

    @property
    def sub_ring(self) -> int:
        return self.key[1]

    @property
    def length(self) -> int:
        return self.rows.stop - self.rows.start

    def positions(self, rows: int) -> slice:
        """The global positions of the tile's first ``rows`` rows."""
        return slice(self.start, self.start + rows)


def on_accelerator(device_type: str) -> bool:
    """Whether tiles (and the masks a step keeps) are sized for the host's cost per call, as
    on an accelerator, or for memory, as on the CPU. The one place that decides it."""
    return device_type != "cpu"


def capturing(device: torch.device) -> bool:
    """Whether work on ``device`` is being recorded into a CUDA graph now."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def tile_rows(device_type: str) -> int:
    """The fewest rows a tile has on ``device_type``: 1024 on the CPU, 4096 on accelerators."""
    return DEVICE_TILE_ROWS if on_accelerator(device_type) else MIN_TILE_ROWS


def tiles_per_chunk(rows: int, layout: str, device_type: str = "cpu") -> int:
    """How many tiles (= sub-rings) each chunk of a ``rows``-row shard is cut into: on the
    CPU as many as keep tiles over ``CPU_TILE_ROWS``, on accelerators as few as keep them
    under ``DEVICE_MAX_TILE_ROWS``; at most ``MAX_TILES_PER_CHUNK``."""
    chunk_rows = rows // chunks_per_rank(layout)
    if on_accelerator(device_type):
        return max(1, min(-(-chunk_rows // DEVICE_MAX_TILE_ROWS), MAX_TILES_PER_CHUNK))
    return max(1, min(chunk_rows // CPU_TILE_ROWS, MAX_TILES_PER_CHUNK))


def rank_tiles(rank: int, ring_size: int, rows: int, layout: str, per_chunk: int) -> list[Tile]:
    """The tiles of rank ``rank``'s shard, in local order."""
    chunk_rows = rows // chunks_per_rank(layout)
    bounds = [chunk_rows * t // per_chunk for t in range(per_chunk + 1)]
    return [
        Tile(
            slice(c * chunk_rows + bounds[t], c * chunk_rows + bounds[t + 1]),
            (chunk, t),
            chunk * chunk_rows + bounds[t],
        )
        for c, chunk in enumerate(rank_chunks(rank, ring_size, layout))
        for t in range(per_chunk)
    ]


def sub_ring_tiles(tiles: list[Tile], sub_ring: int) -> list[Tile]:
    """The tiles that travel together in ``sub_ring``: one per chunk."""
    return [tile for tile in tiles if tile.sub_ring == sub_ring]


# A tiling: the tiles of each rank of the ring, ``tiling(rank)``, in local order.
Tiling = Callable[[int], list[Tile]]


def all_tiles(tiling: Tiling, ring_size: int) -> list[Tile]:
    """Every rank's tiles, in global order."""
    return sorted((t for r in range(ring_size) for t in tiling(r)), key=lambda t: t.key)


class Visibility(enum.Enum):
    """What a query tile sees of a key tile (torch's context parallel: ``_CausalBehavior``)."""

    HIDDEN = "hidden"  # every key after every query: skipped
    DIAGONAL = "diagonal"  # the same global rows: the kernel's top-left causal mask
    FULL = "full"  # every key visible: no mask
    MASKED = "masked"  # some keys visible: the pair's tile of the mask as a bias


def visibility(q_tile: Tile, k_tile: Tile, is_causal: bool) -> Visibility:
    if not is_causal or q_tile.key > k_tile.key:
        return Visibility.FULL
    return Visibility.DIAGONAL if q_tile.key == k_tile.key else Visibility.HIDDEN


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


def sequence_rows(x: torch.Tensor, start: int, length: int, rows_dim: int = 2) -> torch.Tensor:
    """Rows ``start`` to ``start + length`` of a batch of one, ``x`` (1, H, S, D), or with
    ``rows_dim`` 0 a sequence-major (S, 1, H, D) buffer, as FA2's varlen layout (rows, H, D):
    one ``as_strided`` whatever the strides (a narrow and a transpose would be three view
    ops, each a dispatch on a GPU's host)."""
    heads_dim = 1 if rows_dim == 2 else 2
    stride = x.stride()
    return x.as_strided(
        (length, x.shape[heads_dim], x.shape[3]),
        (stride[rows_dim], stride[heads_dim], stride[3]),
        x.storage_offset() + start * stride[rows_dim],
    )
