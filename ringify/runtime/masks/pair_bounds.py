"""Which tile pairs a mask program surely hides or shows whole, from its bounds alone, and so
how finely a program's mask wants a chunk tiled."""

from __future__ import annotations

import torch

from ringify.runtime.collectives.layout import chunks_per_rank
from ringify.runtime.masks.bounds import program_bounds, settled
from ringify.runtime.masks.program import parse, tile_bounds
from ringify.runtime.tiling import tiles as tiling_sizes
from ringify.runtime.tiling.tiles import (
    MAX_BANDED_TILES_PER_CHUNK,
    MIN_TILE_ROWS,
    Tile,
    tile_rows,
    tiles_per_chunk,
)


def settled_pairs(program, inputs, q_tiles, k_tiles, key_len):
    """(surely hidden, surely fully visible): (n, m) bool tensors over the tile pairs."""
    q_starts = [t.start for t in q_tiles]
    q_stops = [t.start + t.length for t in q_tiles]
    k_starts = [t.start for t in k_tiles]
    # padding keys are cut off before the mask is read; a tile of padding keeps one row
    k_stops = [max(t.start + 1, min(t.start + t.length, key_len)) for t in k_tiles]
    bounds = []
    for x, role in zip(inputs, program.roles, strict=True):
        starts, stops = (q_starts, q_stops) if role == "q" else (k_starts, k_stops)
        bounds.append(tile_bounds(x, role, starts, stops))
    q_pos = tuple(torch.tensor(v, dtype=torch.float64).view(-1, 1) for v in (q_starts, q_stops))
    q_pos = (q_pos[0], q_pos[1] - 1)
    k_pos = tuple(torch.tensor(v, dtype=torch.float64).view(1, -1) for v in (k_starts, k_stops))
    k_pos = (k_pos[0], k_pos[1] - 1)
    lo, hi = program_bounds(program, bounds, q_pos, k_pos)
    n, m = len(q_tiles), len(k_tiles)
    return tuple(x.expand(n, m).clone() for x in settled(lo, hi, program.dtype))


def program_tiles_per_chunk(
    program: str, inputs, rows: int, ring_size: int, layout: str, device_type: str = "cpu"
) -> int:
    """Tiles per chunk for a program's mask: on the CPU finer when each query sees a short
    span of keys (a sliding window, short documents), so that the work skipped grows with S.
    On an accelerator open pairs run as FA2 varlen calls whose windows skip that work inside
    the kernel: finer tiles would only multiply the calls (and the sub-rings' trips)."""
    default = tiles_per_chunk(rows, layout, device_type)
    if tiling_sizes.on_accelerator(device_type):
        return default
    chunk = rows // chunks_per_rank(layout)
    block = min(MIN_TILE_ROWS, chunk)
    total = rows * ring_size
    grid = [Tile(slice(a, min(a + block, total)), (a, 0), a) for a in range(0, total, block)]
    hidden, _ = settled_pairs(parse(program), [x.detach() for x in inputs], grid, grid, total)
    span = int((~hidden).sum(1).max()) * block
    if span * default >= chunk:
        return default
    banded = chunk // max(span, tile_rows(device_type))
    return min(MAX_BANDED_TILES_PER_CHUNK, max(default, banded))
