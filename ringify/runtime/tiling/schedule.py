"""The ring schedule: how a shard is tiled, which tiles a rank holds at each step, which pairs work.

The ring ops own the tiling decision (``shard_tiles``): positions matter only
under a causal mask, a mask or padding keys; otherwise any tiling will do and the
shard is tiled as one chunk. Every rank computes the same decision from the
same arguments, so the sub-rings line up.
"""

from __future__ import annotations

from collections.abc import Iterator

from ringify.runtime.collectives.courier import Courier, Parcel
from ringify.runtime.collectives.ring import Ring
from ringify.runtime.tiling.tiles import Tile, rank_tiles, sub_ring_tiles, tiles_per_chunk


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
    travel no further. ``own``: this rank's tiles of the sub-ring; ``held``: the tiles
    of rank ``src`` = (rank - step) held at this step, and ``kv`` their K tiles, then
    their V tiles (both None at a step where nothing is held). The sends of the next
    step start before yielding, so they are in flight while the caller computes.
    """
    mine = tiling(ring.rank)
    for j in sorted({t.sub_ring for t in mine}):
        own = sub_ring_tiles(mine, j)
        last = last_steps(j)
        kv = like = tile_views(own, k, v)  # every rank's tiles of a sub-ring have one shape
        for step in range(ring.size):
            src, nxt = (ring.rank - step) % ring.size, (ring.rank - step - 1) % ring.size
            courier = Courier(ring, Parcel.KV)
            if step + 1 <= last[src]:
                courier.send(courier.peer(1), kv)
            if step + 1 <= last[nxt]:
                courier.receive("kv", courier.peer(-1), like)
            delivery = courier.start()
            held = sub_ring_tiles(tiling(src), j) if step <= last[src] else None
            yield own, step, src, held, kv if held is not None else None
            # the sends are waited for too: their buffers must outlive them
            kv = delivery.wait().get("kv") if delivery is not None else None


def tile_views(own: list[Tile], k, v) -> list:
    """The K tiles, then the V tiles, of this rank's tiles ``own`` (views)."""
    return [x[:, :, t.rows] for x in (k, v) for t in own]
