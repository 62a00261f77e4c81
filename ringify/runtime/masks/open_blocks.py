"""How an open tile pair runs: its blocks classified on the host, then as few kernel calls.

A tile pair that a mask program's bounds leave open is cut into blocks of ``MIN_TILE_ROWS``
(``open_pair``), bounded again, and each block's mask that its bounds leave open is
evaluated once on the host; ``classify`` reads it as hidden, fully visible, the kernels'
causal triangle or masked. ``coalesced`` then joins
the blocks into few calls, since each call costs the host the same launches whatever its
size: the causal triangle of a diagonal pair as one causal call, a mostly visible pair with
a masked block as one masked call, else each row's runs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ringify.runtime.masks.bounds import settled_pairs
from ringify.runtime.masks.calls import RowSpans, VarlenCall
from ringify.runtime.masks.program import MaskProgram, evaluate
from ringify.runtime.tiling.tiles import DEVICE_TILE_ROWS, MIN_TILE_ROWS, Tile, Visibility

_HOST = torch.device("cpu")

# The largest mask one call of a whole open pair evaluates (``_whole_pair``): a GPU tile pair.
MAX_PAIR_MASK = DEVICE_TILE_ROWS * DEVICE_TILE_ROWS


class OpenBlock(NamedTuple):
    """A block of an open pair as the host classified it (``open_pair``)."""

    rows: slice  # local query rows
    cols: slice  # key rows of the held tile (keys no query sees cut off at the end)
    seen: Visibility
    at: tuple[slice, slice]  # global query and key positions
    empty_rows: bool = False  # a masked block with a query row that sees none of its keys


class OpenPair(NamedTuple):
    """An open pair as the host classified it, once per plan: its blocks, those blocks as
    few calls (``coalesced``), and where asked the pair as FA2 varlen calls (or None)."""

    blocks: list[OpenBlock]
    coalesced: list[OpenBlock]
    calls: list[VarlenCall] | None


def open_pair(
    program: MaskProgram, inputs: list[torch.Tensor], key_len: int, q_tile: Tile, k_tile: Tile,
    keys: int, varlen: bool,
) -> OpenPair:  # fmt: skip
    """The pair's blocks of ``MIN_TILE_ROWS`` bounded under ``program`` (its host ``inputs``),
    those left open evaluated on the host and classified; with ``varlen``, each row's run
    of visible keys gathered into FA2 varlen calls (``calls.RowSpans``)."""
    step = MIN_TILE_ROWS
    q_blocks = [
        Tile(slice(q_tile.rows.start + a, q_tile.rows.start + min(a + step, q_tile.length)),
             (0, 0), q_tile.start + a)
        for a in range(0, q_tile.length, step)
    ]  # fmt: skip
    k_blocks = [
        Tile(slice(b, min(b + step, keys)), (0, 0), k_tile.start + b) for b in range(0, keys, step)
    ]
    hidden, full = settled_pairs(program, inputs, q_blocks, k_blocks, key_len)
    hidden, full = hidden.tolist(), full.tolist()  # host tensors: no device read
    spans = RowSpans(q_tile.length) if varlen else None  # each row's run of keys
    grid = []
    for a, qb in enumerate(q_blocks):
        grid.append([])
        for b, kb in enumerate(k_blocks):
            at = (qb.positions(qb.length), kb.positions(kb.length))
            rows = slice(a * step, a * step + qb.length)  # of the pair
            if hidden[a][b] or full[a][b]:
                seen = Visibility.HIDDEN if hidden[a][b] else Visibility.FULL
                grid[-1].append(OpenBlock(qb.rows, kb.rows, seen, at))
                if spans is not None and full[a][b]:
                    spans.add_full(rows, kb.rows)
                continue
            mask = evaluate(program, inputs, *at, _HOST)
            mask = mask.expand(*mask.shape[:-2], qb.length, kb.length)  # a broadcast dim
            if spans is not None:
                spans.add_mask(rows, kb.rows.start, mask)
            seen, kept, empty = classify(mask)
            # keys that no query of the block sees, at its end (padding): cut off
            cols = slice(kb.rows.start, kb.rows.start + kept)
            at = (at[0], slice(at[1].start, at[1].start + kept))
            grid[-1].append(OpenBlock(qb.rows, cols, seen, at, empty))
    blocks = [block for row in grid for block in row]
    nominal = [kb.rows for kb in k_blocks]
    calls = spans.calls() if spans is not None else None
    return OpenPair(blocks, coalesced(grid, q_tile, k_tile, nominal), calls)


def coalesced(grid: list[list], q_tile: Tile, k_tile: Tile, nominal: list[slice]) -> list:
    """The blocks of an open pair as few kernel calls: the whole pair as one causal call if
    its blocks are exactly the causal triangle of a pair on the diagonal (HF's mask is a
    causal program), up to keys no query sees at its end (padding: a row past them sees
    every key kept, as top-left causal has it), else each row's runs of unmasked blocks as
    one. ``nominal``: each block column's key rows before padding keys were cut off."""
    d, f, h = Visibility.DIAGONAL, Visibility.FULL, Visibility.HIDDEN
    # the last block column a query sees: padding may cut it short and hide those after it
    n = 1 + max((b for row in grid for b, block in enumerate(row) if block.seen is not h),
                default=0)  # fmt: skip
    shaped = [
        grid[a][b].seen is (h if b >= n else d if a == b else f if b < a else h)
        and (grid[a][b].seen is h or b == n - 1 or grid[a][b].cols == nominal[b])
        for a in range(len(grid))
        for b in range(len(nominal))
    ]
    last = {row[n - 1].cols.stop for row in grid if row[n - 1].seen is not h}
    aligned = q_tile.start == k_tile.start and q_tile.length == k_tile.length
    if aligned and all(shaped) and len(last) == 1:  # top-left causal on the keys kept
        (stop,) = last
        at = (q_tile.positions(q_tile.length), slice(k_tile.start, k_tile.start + stop))
        return [OpenBlock(q_tile.rows, slice(0, stop), d, at)]
    whole = _whole_pair(grid, q_tile, k_tile)
    if whole is not None:
        return [whole]
    merged = []
    for row in grid:
        for block in row:
            prev = merged[-1] if merged else None
            if prev and prev.rows == block.rows and prev.cols.stop == block.cols.start:
                seen = _run_of(prev.seen, block.seen)
                if seen is not None:
                    at = (prev.at[0], slice(prev.at[1].start, block.at[1].stop))
                    cols = slice(prev.cols.start, block.cols.stop)
                    empty = prev.empty_rows and block.empty_rows  # a row seeing none of both
                    merged[-1] = OpenBlock(prev.rows, cols, seen, at, empty)
                    continue
            merged.append(block)
    return merged


def _whole_pair(grid: list[list], q_tile: Tile, k_tile: Tile) -> OpenBlock | None:
    """An open pair with a masked block and at most a quarter of its blocks hidden, as one
    masked call over its keys (those after the last that a query sees are cut off): one call
    per pair, as an unmasked ring makes, for at most a third more kernel work; its mask at
    most ``MAX_PAIR_MASK`` elements. Else None."""
    m, h = Visibility.MASKED, Visibility.HIDDEN
    blocks = [b for row in grid for b in row]
    seen = [b for b in blocks if b.seen is not h]
    if not any(b.seen is m for b in seen) or 4 * (len(blocks) - len(seen)) > len(blocks):
        return None
    stop = max(b.cols.stop for b in seen)
    if q_tile.length * stop > MAX_PAIR_MASK:
        return None
    # a query sees a key of the call if its row of blocks has an unmasked one, or a masked
    # one with no empty row; else the call may leave it empty
    seeing = [any(b.seen not in (m, h) or (b.seen is m and not b.empty_rows) for b in row)
              for row in grid]  # fmt: skip
    at = (q_tile.positions(q_tile.length), slice(k_tile.start, k_tile.start + stop))
    return OpenBlock(q_tile.rows, slice(0, stop), m, at, not all(seeing))


def _run_of(a: Visibility, b: Visibility) -> Visibility | None:
    """The visibility of two neighbouring blocks of a row run as one call, or None if they
    stay apart: unmasked runs stay unmasked (the flash kernel); a masked block takes its
    masked or causal neighbour into its call (one mask over both: a call fewer for the
    host, at most half a block of masked work more for the kernel)."""
    f, m, d = Visibility.FULL, Visibility.MASKED, Visibility.DIAGONAL
    if a is b is f:
        return f
    if m in (a, b) and {a, b} <= {m, d}:
        return m
    return None


def classify(mask: torch.Tensor) -> tuple[Visibility, int, bool]:
    """A block's mask, evaluated on the host and expanded to the block (a program of query
    positions only has one key column): hidden, full, the causal triangle (top-left, as the
    kernels' ``is_causal``), or masked; how many of its leading key columns some query
    sees (the columns after them, as padding keys, are left out of the block); and whether
    some query row sees none of them (the kernels need that row's result zeroed)."""
    visible = mask if mask.dtype == torch.bool else mask == 0
    hidden = ~mask if mask.dtype == torch.bool else mask == float("-inf")
    if bool(hidden.all()):
        return Visibility.HIDDEN, 0, True
    columns = (~hidden).reshape(-1, hidden.shape[-1]).any(0).nonzero()
    kept = int(columns[-1]) + 1
    visible, hidden = visible[..., :kept], hidden[..., :kept]
    empty = bool(hidden.all(-1).any())
    if bool(visible.all()):
        return Visibility.FULL, kept, empty
    rows = mask.shape[-2]
    tril = torch.ones(rows, kept, dtype=torch.bool).tril()
    if bool((visible == tril).all() and (hidden == ~tril).all()):
        return Visibility.DIAGONAL, kept, empty
    return Visibility.MASKED, kept, empty
