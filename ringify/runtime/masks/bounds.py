"""Bounds of a mask program over tile pairs: which are surely hidden, surely fully visible, and
so how finely a program's mask wants a chunk tiled.

Interval arithmetic: each input is replaced by its (min, max) over a tile, positions
by the tile's first and last; every instruction maps intervals to an interval that
holds all its possible values, for every (query tile, key tile) pair at once as
(n, m) tensors. A bool mask whose interval is [0, 0] hides the whole pair, [1, 1]
shows all of it; a float mask shows all of it at [0, 0] and hides it at
[-inf, -inf]. Anything the bounds cannot settle (a NaN, an op without an interval
rule) is *mixed*: the op evaluates that pair exactly. Bounds only ever widen, so a
pair is never skipped or unmasked wrongly.
"""

from __future__ import annotations

import torch

from ringify.runtime.collectives.layout import chunks_per_rank
from ringify.runtime.masks.program import MaskProgram, parse, resolve, tile_bounds
from ringify.runtime.tiling import tiles as tiling_sizes
from ringify.runtime.tiling.tiles import (
    MAX_BANDED_TILES_PER_CHUNK,
    MIN_TILE_ROWS,
    Tile,
    tile_rows,
    tiles_per_chunk,
)

_INF = float("inf")


def program_bounds(program: MaskProgram, inputs: list, q_pos: tuple, k_pos: tuple):
    """(lo, hi) of the mask over every tile pair; ``inputs[i]`` and ``q_pos``/``k_pos``
    are (lo, hi) pairs of float64 tensors: (n, 1) for queries, (1, m) for keys."""
    results: list[tuple] = []
    for op, args, dtype in program.code:
        vals = [resolve(a, inputs, results, q_pos, k_pos, _point) for a in args]
        results.append(_bound(op, vals, dtype, q_pos, k_pos))
    return results[-1]


def _point(a):
    """A literal number as the interval [a, a]."""
    if not isinstance(a, (bool, int, float)):
        return a
    t = torch.tensor(float(a), dtype=torch.float64)
    return t, t


def _unknown():
    return torch.tensor(-_INF, dtype=torch.float64), torch.tensor(_INF, dtype=torch.float64)


def _bool(all_true, any_true):
    """The interval of a bool result that is surely true where ``all_true``, surely false
    where not ``any_true``."""
    return all_true.double(), any_true.double()


def _compare(name: str, a, b):
    (alo, ahi), (blo, bhi) = a, b
    unknown = alo.isnan() | ahi.isnan() | blo.isnan() | bhi.isnan()
    all_true, any_true = _compared(name, alo, ahi, blo, bhi)
    return _bool(all_true & ~unknown, any_true | unknown)


def _compared(name: str, alo, ahi, blo, bhi):
    """(surely true, possibly true) of ``a <name> b`` from the bounds."""
    if name == "le":
        return ahi <= blo, alo <= bhi
    if name == "lt":
        return ahi < blo, alo < bhi
    if name == "ge":
        return alo >= bhi, ahi >= blo
    if name == "gt":
        return alo > bhi, ahi > blo
    same = (alo == ahi) & (blo == bhi) & (alo == blo)
    apart = (ahi < blo) | (bhi < alo)
    return (same, ~apart) if name == "eq" else (apart, ~same)


def _where(c, a, b):
    (clo, chi), (alo, ahi), (blo, bhi) = c, a, b
    lo = torch.where(clo >= 1, alo, torch.where(chi < 1, blo, torch.minimum(alo, blo)))
    hi = torch.where(clo >= 1, ahi, torch.where(chi < 1, bhi, torch.maximum(ahi, bhi)))
    return lo, hi


def _corners(f, a, b):
    values = [f(x, y) for x in a for y in b]
    lo, hi = values[0], values[0]
    for v in values[1:]:
        lo, hi = torch.minimum(lo, v), torch.maximum(hi, v)
    return lo, hi


def _cast(x, dtype: str):
    lo, hi = x
    if dtype == "bool":  # x != 0
        return _bool((lo > 0) | (hi < 0), (lo != 0) | (hi != 0))
    if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()) and dtype.startswith("int"):
        return _unknown()
    target = getattr(torch, dtype)  # every cast rounds monotonically: cast the bounds
    return lo.to(target).double(), hi.to(target).double()


def _bound(op: str, args: list, dtype: str, q_pos, k_pos):
    name = op.split(".")[0]
    if op == "cast":
        return _cast(args[0], dtype)
    if op == "const":
        return args[0]
    if name in ("le", "lt", "ge", "gt", "eq", "ne"):
        return _compare(name, *args[:2])
    logical = dtype == "bool"
    if logical and name in ("__and__", "bitwise_and", "logical_and"):
        return torch.minimum(args[0][0], args[1][0]), torch.minimum(args[0][1], args[1][1])
    if logical and name in ("__or__", "bitwise_or", "logical_or"):
        return torch.maximum(args[0][0], args[1][0]), torch.maximum(args[0][1], args[1][1])
    if name == "logical_not" or (logical and name == "bitwise_not"):
        lo, hi = _cast(args[0], "bool")
        return 1 - hi, 1 - lo
    if name == "add":
        return args[0][0] + args[1][0], args[0][1] + args[1][1]
    if name == "sub":
        return args[0][0] - args[1][1], args[0][1] - args[1][0]
    if name == "rsub":
        return args[1][0] - args[0][1], args[1][1] - args[0][0]
    if name == "neg":
        return -args[0][1], -args[0][0]
    if name == "mul":
        return _finite_or_unknown(_corners(torch.mul, *args[:2]))
    if name in ("maximum", "max"):
        return torch.maximum(args[0][0], args[1][0]), torch.maximum(args[0][1], args[1][1])
    if name in ("minimum", "min"):
        return torch.minimum(args[0][0], args[1][0]), torch.minimum(args[0][1], args[1][1])
    if name in ("exp", "log", "sqrt"):  # monotone: NaN (log of a negative) is unknown
        f = getattr(torch, name)
        return _finite_or_unknown((f(args[0][0]), f(args[0][1])))
    if op == "embed":  # any entry of the table
        return _finite_or_unknown(args[0])
    if name == "where":
        return _where(*args)
    if name == "masked_fill":
        return _where(args[1], args[2], args[0])
    if name in ("tril", "triu"):
        x, diagonal = args[0], args[1][0]
        offset = (k_pos[0] - q_pos[1], k_pos[1] - q_pos[0])  # key - query
        zero = (torch.zeros(()).double(),) * 2
        below = (offset[1] <= diagonal, offset[0] <= diagonal)  # (all kept, any kept) by tril
        above = (offset[0] >= diagonal, offset[1] >= diagonal)
        every, some = below if name == "tril" else above
        return _where(_bool(every, some), x, zero)
    return _unknown()  # abs, div, remainder, ...: the pair is evaluated


def _finite_or_unknown(bounds):
    lo, hi = bounds
    bad = torch.isnan(lo) | torch.isnan(hi)
    return torch.where(bad, -_INF, lo), torch.where(bad, _INF, hi)


def settled(lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype):
    """(surely hidden, surely fully visible) per tile pair, from the mask's bounds."""
    if dtype == torch.bool:
        return hi < 1, lo >= 1
    return hi == -_INF, (lo == 0) & (hi == 0)


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
