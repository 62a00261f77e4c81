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
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from ringify.runtime.collectives.layout import chunks_per_rank, rank_chunks

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
