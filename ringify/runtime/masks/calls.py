"""The kernel calls of one ring step, and whole tile pairs joined into fewer of them.

Each call costs the host the same launches (slices, the kernel, the merge) whatever its
size. So the pairs of a step that run unmasked as whole pairs (fully visible, or the
kernels' causal triangle on the diagonal) join where their rows allow, as PyTorch's ring
runs one call per step:

- the shard's own tiles at the first step, each seeing the tiles before it whole and its
  own causally, are one causal call over the shard's rows (their local order is global);
- a query tile's fully visible key tiles side by side are one call, and adjacent query
  tiles with the same run of key tiles are one call.

Key tiles join only where they lie side by side in memory (``HeldKV.joined``), query
tiles only where their rows are the shard's own (no balanced plan moved them). A held tile
whose last keys no query sees (padding, cut off) may join only as the last of its call:
the call's keys then stop where its keys do (top-left causal on the shard's rows is still
exact: a row past the cut sees every key before it).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch

from ringify.runtime.masks.varlen import Varlen, fa2_takes, sequences_call
from ringify.runtime.tiling.tiles import Tile, Visibility


@dataclass(frozen=True)
class Block:
    """One kernel call of a step: query rows of this rank's shard x key rows of the held
    tiles ``held`` to ``held + tiles - 1``, side by side."""

    held: int  # index into the held tiles of the first
    rows: slice  # local query rows
    cols: slice  # key rows of the held tiles, side by side
    seen: Visibility
    bias: torch.Tensor | None
    at: tuple[slice, slice] | None  # global query and key positions (None: joined pairs)
    empty_rows: bool = True  # may a query row see no key of the block (False: surely not)
    tiles: int = 1
    varlen: Varlen | None = None  # FA2's sequences and window (``masks/varlen.py``), or None


def joined(whole: dict[tuple[int, int], Block], mine: list[Tile], held: list[Tile],
           rows_joined: bool, keys_joined: bool) -> list[Block]:  # fmt: skip
    """The whole-pair blocks of a step, ``whole[query tile index, held tile index]``, as few
    calls: ``rows_joined``, adjacent query tiles may join; ``keys_joined``, held tiles may."""
    d, f = Visibility.DIAGONAL, Visibility.FULL
    n = len(held)
    # (query tile, held tile) -> the keys it sees of the tile, where they stop short of it
    cut = {key: b.cols.stop for key, b in whole.items() if b.cols.stop < held[key[1]].length}

    def keys(a: int, first: int, count: int) -> slice:  # side by side, the last maybe cut
        last = first + count - 1
        stop = cut.get((a, last), held[last].length)
        return slice(0, sum(t.length for t in held[first:last]) + stop)

    rows_adjacent = rows_joined and all(
        a.rows.stop == b.rows.start for a, b in itertools.pairwise(mine)
    )
    if rows_adjacent and keys_joined and [t.key for t in mine] == [t.key for t in held]:
        want = {(a, i): d if a == i else f for a in range(n) for i in range(a + 1)}
        if {key: b.seen for key, b in whole.items()} == want and set(cut) <= {(n - 1, n - 1)}:
            rows = slice(mine[0].rows.start, mine[-1].rows.stop)
            return [Block(0, rows, keys(n - 1, 0, n), d, None, None, False, n)]
    calls = [b for b in whole.values() if b.seen is not f]
    runs: list[tuple[int, int, int, slice]] = []  # (query tile, first held, held tiles, keys)
    for a in range(len(mine)):
        full = sorted(i for (q, i), b in whole.items() if q == a and b.seen is f)
        for _, group in itertools.groupby(enumerate(full), lambda x: x[1] - x[0]):
            group = [i for _, i in group]
            ends = {i for i in group if (a, i) in cut}  # a cut tile ends its run
            spans = _spans(group, ends) if keys_joined else [[i] for i in group]
            runs += [(a, span[0], len(span), keys(a, span[0], len(span))) for span in spans]
    order = lambda r: (r[1], r[2], r[3].stop)
    runs.sort(key=lambda r: (*order(r), r[0]))
    for (first, count, stop), group in itertools.groupby(runs, order):
        queries = [a for a, *_ in group]
        for rows in _adjacent_rows(queries, mine, rows_joined):
            calls.append(Block(first, rows, slice(0, stop), f, None, None, False, count))
    return calls


def _spans(tiles: list[int], ends: set[int]) -> list[list[int]]:
    """Consecutive held tiles as runs that join, each ending at a tile of ``ends`` (or the end)."""
    spans: list[list[int]] = [[]]
    for i in tiles:
        spans[-1].append(i)
        if i in ends:
            spans.append([])
    return [span for span in spans if span]


def _adjacent_rows(queries: list[int], mine: list[Tile], join: bool) -> list[slice]:
    """The local rows of query tiles ``queries`` (ascending), adjacent ones joined if ``join``."""
    spans: list[slice] = []
    for a in queries:
        rows = mine[a].rows
        if join and spans and spans[-1].stop == rows.start:
            spans[-1] = slice(spans[-1].start, rows.stop)
        else:
            spans.append(rows)
    return spans


def joined_varlen(blocks: list[Block], held: list[Tile], rows_joined: bool, keys_joined: bool):
    """A step's FA2 varlen blocks as few calls: one whose query rows and keys run on from
    another's, with the same window, joins it as more sequences (the shard's own tiles at the
    first step under a window: one call, as ``is_causal`` makes one)."""
    starts = list(itertools.accumulate((t.length for t in held), initial=0))
    calls: list[Block] = []
    for b in sorted(blocks, key=lambda b: b.rows.start):
        if calls and rows_joined and keys_joined and _runs_on(calls[-1], b, starts):
            calls[-1] = _join(calls[-1], b, starts)
        else:
            calls.append(b)
    return calls


def _runs_on(a: Block, b: Block, starts: list[int]) -> bool:
    """Whether ``b``'s rows and keys (in the held tiles side by side) start where ``a``'s
    stop, under the same window."""
    keys_on = starts[a.held] + a.cols.stop == starts[b.held] + b.cols.start
    return a.varlen.window == b.varlen.window and a.rows.stop == b.rows.start and keys_on


def _join(a: Block, b: Block, starts: list[int]) -> Block:
    cu = torch.cat([a.varlen.cu, b.varlen.cu[:, 1:] + a.varlen.cu[:, -1:]], 1)
    longest = (max(a.varlen.max_rows, b.varlen.max_rows), max(a.varlen.max_keys, b.varlen.max_keys))
    varlen = Varlen(cu, *longest, a.varlen.window)
    rows = slice(a.rows.start, b.rows.stop)
    cols = slice(a.cols.start, starts[b.held] + b.cols.stop - starts[a.held])
    tiles = b.held - a.held + 1
    return Block(a.held, rows, cols, a.seen, None, None, False, tiles, varlen)


def as_varlen(block: Block) -> Block | None:
    """A top-left causal block (square, or its last keys cut off: fewer keys than rows) as one
    FA2 sequence: FA2's window is bottom-right aligned, so ``(-1, s - t)`` on s rows and t
    keys is top-left causal. None where FA2 would not take that window as given
    (``varlen.fa2_takes``), or the block is no such one."""
    s, t = block.rows.stop - block.rows.start, block.cols.stop - block.cols.start
    causal = block.seen is Visibility.DIAGONAL and block.bias is None and block.cols.start == 0
    if not causal or not 0 < t <= s or not fa2_takes((-1, s - t), t):
        return None
    call = sequences_call([(0, s, 0, t)], (-1, s - t))
    return dataclasses.replace(block, varlen=call.varlen, empty_rows=False)


def cut_causal_as_varlen(blocks: list[Block]) -> list[Block]:
    """``blocks``, each causal one with its last keys cut off (padding) as one FA2 sequence
    where it can be (``as_varlen``): the kernels' top-left squaring (``flash.causal_parts``)
    makes it two calls and a copy to join their results."""
    cut = lambda b: b.cols.stop - b.cols.start < b.rows.stop - b.rows.start
    return [(cut(b) and as_varlen(b)) or b for b in blocks]
