"""An open tile pair as FlashAttention varlen calls: one call where the blocks need many.

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

import functools
from dataclasses import dataclass

import torch


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
