"""The kernel calls of one ring step: whole tile pairs joined, open pairs as varlen calls.

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

An open tile pair runs as FlashAttention varlen calls: one call where the blocks need many.
Packed documents and sliding windows leave a tile pair open: cut into blocks, it runs as a
call per block row, each masked one with a bias (``open_blocks.py``), hundreds of calls per
step at 32K-128K. FlashAttention-2 takes the structure itself, as HF's packed sequences and
Mistral's window use it: sequences side by side (``cu_seqlens``), each attending with a
window (``window_size_left/right``, bottom-right aligned as its causal mask is). Where each
query row of a pair sees one contiguous run of keys, ``[lo, hi)``, that is enough:

- the rows are cut into pieces where a run starts anew (``lo`` or ``hi`` jumps: a document
  boundary) or a row sees nothing (those rows are in no call);
- in a piece, every row's run is FA2's window on the piece's keys ``[c, e)`` for one
  ``(left, right)``: row j sees keys ``[j + t - s - left, j + t - s + right]`` of them, -1
  leaving a side open (a document: (-1, 0); a window: (w - 1, 0), its first rows cut at
  ``c``; a block fully seen: (-1, -1)); ``piece`` solves for it, or finds none;
- pieces side by side in rows and keys with the same window are one call, each a sequence.

Each call's rows see at least one key, so no result needs zeroing.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass

import torch

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
    varlen: Varlen | None = None  # FA2's sequences and window (``masks/calls.py``), or None


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
    (``fa2_takes``), or the block is no such one."""
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


@dataclass(frozen=True)
class Varlen:
    """One FA2 varlen call: its sequences' cumulative query rows and keys (``cu``, (2, n + 1)
    int32 on the host, moved to the device once per step), the longest of each, its window."""

    cu: torch.Tensor
    max_rows: int
    max_keys: int
    window: tuple[int, int]

    @property
    def is_causal(self) -> bool:
        return self.window == (-1, 0)

    @functools.cached_property
    def cu_seqlens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``cu`` as FA2's two arguments, query rows and keys: split once, not in every call."""
        cu_q, cu_k = self.cu.unbind()
        return cu_q, cu_k


@dataclass(frozen=True)
class VarlenCall:
    """A call of an open pair: query rows ``rows`` (of the pair's query tile, from 0) x key rows
    ``cols`` (of the held tile), as ``varlen`` sequences."""

    rows: slice
    cols: slice
    varlen: Varlen


class RowSpans:
    """Which keys each query row of a pair sees, gathered block by block: its first and last
    seen key and how many it sees (contiguous iff ``hi - lo`` is that many)."""

    def __init__(self, rows: int):
        self.lo = torch.full((rows,), torch.iinfo(torch.int64).max, dtype=torch.int64)
        self.hi = torch.zeros(rows, dtype=torch.int64)
        self.count = torch.zeros(rows, dtype=torch.int64)
        self.pure = True  # every mask was 0 or -inf (a bias with other values is no window)

    def add_full(self, rows: slice, cols: slice) -> None:
        self._add(rows, torch.tensor(cols.start), torch.tensor(cols.stop), cols.stop - cols.start)

    def add_mask(self, rows: slice, col0: int, mask: torch.Tensor) -> None:
        """A block's evaluated mask (bool, or additive), (..., s, t) expanded to the block's
        rows and keys, with unit leading dims."""
        if mask.shape[:-2].numel() != 1:  # per batch or head: not one run per row
            self.pure = False
            return
        mask = mask.reshape(mask.shape[-2:])
        if mask.dtype == torch.bool:
            seen = mask
        else:
            seen = mask == 0
            self.pure &= bool((seen | (mask == float("-inf"))).all())
        t = seen.shape[-1]
        any_ = seen.any(-1)
        first = torch.where(any_, seen.int().argmax(-1), t)
        last = torch.where(any_, t - seen.flip(-1).int().argmax(-1), 0)
        self._add(rows, col0 + first, col0 + last, seen.sum(-1))

    def _add(self, rows: slice, lo, hi, count) -> None:
        seen = torch.as_tensor(count) > 0
        self.lo[rows] = torch.where(seen, torch.minimum(self.lo[rows], lo), self.lo[rows])
        self.hi[rows] = torch.where(seen, torch.maximum(self.hi[rows], hi), self.hi[rows])
        self.count[rows] += count

    def calls(self) -> list[VarlenCall] | None:
        """The pair as varlen calls, or None where some row's keys are not one run."""
        seen = self.count > 0
        if not self.pure or bool((seen & (self.hi - self.lo != self.count)).any()):
            return None
        return varlen_calls(torch.where(seen, self.lo, 0), torch.where(seen, self.hi, 0))


def varlen_calls(lo: torch.Tensor, hi: torch.Tensor) -> list[VarlenCall] | None:
    """Rows whose keys are ``[lo, hi)`` (``lo >= hi``: none) as few varlen calls, or None
    where a piece is no FA2 window."""
    seen = hi > lo
    steps = ((lo.diff() == 0) | (lo.diff() == 1)) & ((hi.diff() == 0) | (hi.diff() == 1))
    go_on = torch.cat([torch.tensor([False]), steps & seen[1:] & seen[:-1]])
    starts = (seen & ~go_on).nonzero().flatten().tolist()
    stops = (seen & ~torch.cat([go_on[1:], torch.tensor([False])])).nonzero().flatten().tolist()
    pieces = []
    for a, last in zip(starts, stops, strict=True):
        solved = _fa2_pieces(lo, hi, a, last + 1)
        if solved is None:
            return None
        pieces += solved
    calls: list[list] = []
    for a, b, c, e, window in pieces:
        last = calls[-1] if calls else None
        if last and last[-1] == window and last[0][-1][1] == a and last[0][-1][3] == c:
            last[0].append((a, b, c, e))
        else:
            calls.append([[(a, b, c, e)], window])
    return [sequences_call(sequences, window) for sequences, window in calls]


def _fa2_pieces(lo: torch.Tensor, hi: torch.Tensor, a: int, b: int) -> list[tuple] | None:
    """Rows ``a:b`` (one run of ``lo``/``hi`` steps) as ``(a, b, c, e, window)`` pieces, or
    None. Where FA2 would not take the window solved as given (``fa2_takes``: its right side
    as wide as the keys, more rows than keys, most of them past the last: causal rows over
    padding keys), the rows it bounds are a piece of their own, and those that see up to the
    last key another (``hi`` only grows in a run). A left side is never that wide: it is
    shorter than the keys before the diagonal."""
    solved = piece(lo[a:b], hi[a:b])
    if solved is None:
        return None
    c, e, window = solved
    if fa2_takes(window, e - c):  # the call's longest keys are at least e - c
        return [(a, b, *solved)]
    cut = a + int((hi[a:b] == e).int().argmax())  # the first row that sees the last key
    head, tail = _fa2_pieces(lo, hi, a, cut), _fa2_pieces(lo, hi, cut, b)
    return None if head is None or tail is None else head + tail


def fa2_takes(window: tuple[int, int], keys: int) -> bool:
    """Whether FA2 takes ``window`` as given on a call whose longest sequence has ``keys``
    keys: it reads a side at least that wide as no bound, -1 (``flash_api.cpp``:
    ``if (window_size_right >= max_seqlen_k) window_size_right = -1``), silently."""
    return all(side < keys for side in window)


def piece(lo: torch.Tensor, hi: torch.Tensor) -> tuple[int, int, tuple[int, int]] | None:
    """``(c, e, (left, right))``: the keys ``[c, e)`` and the FA2 window under which row j of
    these sees exactly ``[lo[j], hi[j])``; None if no window does."""
    s, c, e = len(lo), int(lo.min()), int(hi.max())
    diagonal = c + torch.arange(s) + (e - c) - s  # the key FA2's bottom-right diagonal is at
    left = _side(diagonal - lo, lo > c, diagonal - c)
    right = _side(hi - 1 - diagonal, hi < e, e - 1 - diagonal)
    if left is None or right is None:
        return None
    return c, e, (left, right)


def _side(width: torch.Tensor, bounded: torch.Tensor, to_edge: torch.Tensor) -> int | None:
    """One side of the window: the same ``width`` on every row it bounds (-1 if none), which
    reaches the sequence's edge (``to_edge`` or further) on every row it does not."""
    if not bool(bounded.any()):
        return -1
    widths = width[bounded]
    w = int(widths[0])
    if w < 0 or bool((widths != w).any()) or bool((to_edge[~bounded] > w).any()):
        return None
    return w


def sequences_call(
    sequences: list[tuple[int, int, int, int]], window: tuple[int, int]
) -> VarlenCall:
    """One call of ``sequences``, each (first row, row stop, first key, key stop), side by side
    in rows and keys, under one FA2 ``window``."""
    rows = [b - a for a, b, _, _ in sequences]
    keys = [e - c for _, _, c, e in sequences]
    cu = torch.tensor([[0, *rows], [0, *keys]], dtype=torch.int32).cumsum(1, dtype=torch.int32)
    first, last = sequences[0], sequences[-1]
    assert fa2_takes(window, max(keys)), (window, max(keys))  # else FA2 would widen it
    varlen = Varlen(cu, max(rows), max(keys), window)
    return VarlenCall(slice(first[0], last[1]), slice(first[2], last[3]), varlen)
