"""The ring schedule: how a shard is tiled, which tiles a rank holds at each step, which pairs work.

The ring ops own the tiling decision (``shard_tiles``): positions matter only
under a causal mask, a mask or padding keys; otherwise any tiling will do and the
shard is tiled as one chunk. Every rank computes the same decision from the
same arguments, so the sub-rings line up.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ringify.runtime.block_attention import additive_mask
from ringify.runtime.p2p import start_rotation
from ringify.runtime.ring import Ring
from ringify.runtime.tiles import (
    Tile,
    Visibility,
    rank_tiles,
    sub_ring_tiles,
    tiles_per_chunk,
    visibility,
)

_KV_TAG = 0


def needs_positions(attn_mask, is_causal: bool, key_len: int, total_rows: int) -> bool:
    """Whether the op needs each tile's global positions (else any tiling will do)."""
    return is_causal or attn_mask is not None or key_len < total_rows


def shard_tiles(
    rank: int, ring_size: int, rows: int, layout: str, positional: bool, per_chunk: int
):
    """Rank ``rank``'s tiles; ``per_chunk=0`` lets ``tiles_per_chunk`` choose."""
    layout = layout if positional else "contiguous"
    per_chunk = per_chunk or tiles_per_chunk(rows, layout)
    return rank_tiles(rank, ring_size, rows, layout, per_chunk)


def ring_visits(ring: Ring, k, v, tiling) -> Iterator[tuple[list[Tile], int, list[Tile], list]]:
    """Walk every sub-ring round the ring: yields ``(own, step, held, kv)``.

    ``tiling(rank)`` gives a rank's tiles. ``own``: this rank's tiles of the
    sub-ring; ``held``: the tiles of rank (rank - step) held at this step; ``kv``:
    their K tiles, then their V tiles. The rotation to the next step is started
    before yielding, so it is in flight while the caller computes, and waited on
    when the caller asks for the next step.
    """
    mine = tiling(ring.rank)
    for j in sorted({t.sub_ring for t in mine}):
        own = sub_ring_tiles(mine, j)
        kv = [x[:, :, t.rows] for x in (k, v) for t in own]
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            pending = start_rotation(ring, kv, tag=_KV_TAG) if step < ring.size - 1 else None
            held = sub_ring_tiles(tiling(src), j)
            yield own, step, held, kv
            if pending is not None:
                kv = pending.wait()


def tile_pairs(mine: list[Tile], held: list[Tile], is_causal: bool, key_len: int):
    """Every tile pair with work: ``(index into held, query rows, kernel's is_causal, keys)``.

    ``keys`` is how many leading rows of the held tile are real keys: the rows at
    global positions >= ``key_len`` are padding and are cut off (a tile of padding only
    is skipped).
    """
    for i, k_tile in enumerate(held):
        keys = min(k_tile.rows.stop - k_tile.rows.start, key_len - k_tile.start)
        if keys <= 0:
            continue
        for q_tile in mine:
            seen = visibility(q_tile, k_tile, is_causal)
            if seen is not Visibility.HIDDEN:
                yield i, q_tile.rows, seen is Visibility.DIAGONAL, keys


def tile_bias(mask: torch.Tensor | None, rows: slice, k_tile: Tile, keys: int, dtype):
    """The additive mask of one tile pair: this rank's query rows, the held tile's key columns.

    ``mask`` has any shape SDPA accepts (1-D to 4-D, size-1 dims broadcast): it is
    viewed as 4-D and a size-1 query or key dim stays a broadcast, never sliced.
    """
    if mask is None:
        return None
    return additive_mask(tile_of(mask, rows, k_tile, keys), dtype)


def tile_of(mask: torch.Tensor, rows: slice, k_tile: Tile, keys: int) -> torch.Tensor:
    """``mask`` (or its gradient) viewed as 4-D, at one tile pair's rows and key columns
    (a size-1 query or key dim stays a broadcast); a view, to read or to add into."""
    mask = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
    q_part = rows if mask.shape[2] > 1 else slice(None)
    k_part = slice(k_tile.start, k_tile.start + keys) if mask.shape[3] > 1 else slice(None)
    return mask[:, :, q_part, k_part]
