"""What each (query tile, key tile) pair of one ring call sees, whatever the mask's form.

A call has one of: the kernel's ``is_causal``; a mask tensor (sliced per pair); a
mask program (``masks/program.py``), bounded for all pairs at once
(``masks/bounds.py``) and evaluated only for the pairs the bounds leave open, at
one pair's size. Every pair ends up in one ``Visibility``: skipped, run with the
kernel's causal mask, with no mask, or with its tile of the mask as a bias.

From the same answers, without evaluating anything, ``last_steps`` says how far
round the ring each rank's key tiles are needed: beyond that step they are not sent
(a sliding window's keys go one rank on, not round the whole ring).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter

import torch

from ringify.runtime.masks.additive import additive_mask
from ringify.runtime.masks.calls import (
    Block,
    as_varlen,
    cut_causal_as_varlen,
    joined,
    joined_varlen,
)
from ringify.runtime.masks.open_blocks import OpenBlock, classify, coalesced
from ringify.runtime.masks.pair_bounds import settled_pairs
from ringify.runtime.masks.program import evaluate, parse
from ringify.runtime.masks.step_masks import KeptMasks
from ringify.runtime.masks.varlen import RowSpans, VarlenCall
from ringify.runtime.tiling.tiles import (
    MIN_TILE_ROWS,
    Tile,
    Visibility,
    all_tiles,
    sub_ring_tiles,
    visibility,
)

_HOST = torch.device("cpu")
_HIDDEN = Visibility.HIDDEN.value


class TileMasks:
    """The visibility of every tile pair of one call (the same on every rank). The key
    tiles of each rank are those of its shard, ``home(rank)``; so are its query tiles
    unless ``working_on`` gives it others (a balanced plan, ``masks/balance.py``).

    A program is bounded and its open blocks classified on the host, from ``inputs``:
    host copies of its inputs (``masks/plan.py`` makes them once per model call), so
    that nothing here reads a device tensor or mixes one with a host tensor. The blocks
    that need their mask evaluate it from the inputs of the call they run in, on its
    device (``bound_to``): device work, no host read."""

    def __init__(
        self, home, ring_size, attn_mask, is_causal, key_len, program, inputs, varlen=False
    ):
        self.home, self._queries, self.ring_size = home, home, ring_size
        self.mask, self.is_causal, self.key_len = attn_mask, is_causal, key_len
        self.program = parse(program) if program else None
        self.varlen = varlen and self.program is not None  # work out open pairs' varlen calls
        self.inputs = [x.detach() for x in inputs]
        self._run_inputs, self._device = self.inputs, _HOST  # until ``bound_to`` a call
        self._kept: KeptMasks | None = None
        self._open: dict[tuple, list] = {}  # an open pair's blocks and their visibility
        self._steps: dict[tuple, tuple] = {}  # a step's blocks and pair counts (``pairs``)
        self._bound: tuple | None = None  # the last ``bound_to``: (its key, it, what it holds)
        tiles = all_tiles(home, ring_size)
        self._index = {t.key: i for i, t in enumerate(tiles)}
        self._maybe = self._maybe_seen(tiles)  # (n, n): could the pair see anything at all
        if self.program is not None:
            hidden, self._full = settled_pairs(self.program, self.inputs, tiles, tiles, key_len)
            self._maybe &= ~hidden
            self._full = self._full.tolist()
        self._maybe_list = self._maybe.tolist()
        self._last: dict[int, list[int]] = {}
        # tile pairs of the forward calls, by the value of what they saw (``bound_to`` gives
        # a step's plan's own)
        self._counts: Counter = Counter()

    def may_see(self, q_tile: Tile, k_tile: Tile) -> bool:
        """Whether the queries of ``q_tile`` may see a key of ``k_tile`` (else: surely not)."""
        return self._maybe_list[self._index[q_tile.key]][self._index[k_tile.key]]

    def working_on(self, queries) -> TileMasks:
        """These masks with ``queries(rank)`` the query tiles of each rank."""
        moved = copy.copy(self)
        moved._queries, moved._last, moved._steps, moved._bound = queries, {}, {}, None
        return moved

    def bound_to(
        self, inputs: list[torch.Tensor], device: torch.device, kept: KeptMasks | None = None,
        counts: Counter | None = None,
    ) -> TileMasks:  # fmt: skip
        """These masks, evaluating the blocks that need their mask from ``inputs`` (the
        program's inputs as the running call holds them) on ``device``; ``kept``: the
        step's masks evaluated by an earlier call (``masks/step_masks.py``), to reuse and add to.
        (An op's body runs below autograd: nothing it computes from ``inputs`` is recorded.)"""
        # every layer of a step binds the same inputs: the last binding is kept (it holds
        # them, so their ids stay theirs)
        key = (*map(id, inputs), device, id(kept), id(counts))
        if self._bound is None or self._bound[0] != key:
            bound = copy.copy(self)
            bound._run_inputs, bound._device, bound._kept = inputs, device, kept
            bound._counts = self._counts if counts is None else counts
            bound._bound = None
            self._bound = (key, bound, kept)
        return self._bound[1]

    def _maybe_seen(self, tiles: list[Tile]) -> torch.Tensor:
        n = len(tiles)
        keys = torch.tensor([self.keys(t) > 0 for t in tiles]).view(1, n)
        if not self.is_causal:
            return keys.expand(n, n).clone()
        order = torch.arange(n)  # tiles are sorted by global position: causal is by order
        return (order.view(1, n) <= order.view(n, 1)) & keys

    def keys(self, k_tile: Tile) -> int:
        """How many leading rows of ``k_tile`` are real keys (the rest are padding)."""
        return min(k_tile.length, self.key_len - k_tile.start)

    def last_steps(self, sub_ring: int) -> list[int]:
        """For each rank, the last ring step at which some rank sees its key tiles of
        ``sub_ring`` (-1: no rank does)."""
        if sub_ring not in self._last:
            self._last[sub_ring] = self._last_steps(sub_ring)
        return self._last[sub_ring]

    def _last_steps(self, sub_ring: int) -> list[int]:
        last = []
        for src in range(self.ring_size):
            cols = [self._index[t.key] for t in sub_ring_tiles(self.home(src), sub_ring)]
            seen = [
                s
                for s in range(self.ring_size)
                if any(
                    self._maybe_list[self._index[q.key]][c]
                    for q in self._queries((src + s) % self.ring_size)
                    for c in cols
                )
            ]
            last.append(max(seen, default=-1))
        return last

    def skip(self, mine: list[Tile], held: int) -> None:
        """Count the pairs of a step at which the held tiles did not come: all hidden."""
        self._counts[_HIDDEN] += len(mine) * held

    def pairs(
        self, mine, held, dtype: torch.dtype, count: bool = False, biased: bool = False,
        joinable: bool = False, varlen: bool = False,
    ):  # fmt: skip
        """Every ``Block`` with work. A pair is one block, except a pair of a program its
        bounds leave open: that is cut into blocks of ``MIN_TILE_ROWS``, bounded again and
        evaluated block by block, so that most run with no mask or are skipped and no
        evaluation or bias is larger than a block. ``biased``: every block that is not
        hidden carries its bias, even a zero one (a learned program's gradient needs it).
        The step's unmasked whole pairs come last, joined into few calls (``calls.py``;
        ``joinable``: the held tiles lie side by side in memory). ``varlen``: an open pair whose
        rows each see one run of keys is instead FA2 varlen calls (``masks/varlen.py``), where
        the plan worked them out (on an accelerator); a step's varlen calls, and its square
        causal pairs with them, join as one call's sequences where they run on
        (``calls.joined_varlen``).

        Under a program the blocks of a step are the same in every call of the plan: they
        are worked out once and kept; each call adds only its masked blocks' biases, or its
        varlen calls' sequences on the device (both made by the step's first call)."""
        if self.mask is not None:  # a mask tensor: the call's own, biases and all
            counts = Counter()
            yield from self._pairs(mine, held, dtype, counts, biased, joinable, False)
            if count:
                self._counts.update({seen.value: n for seen, n in counts.items()})
            return
        varlen = varlen and not biased  # a learned program's gradient needs every bias
        key = (tuple(t.key for t in mine), tuple(t.key for t in held), biased, joinable, varlen)
        if key not in self._steps:
            counts: Counter = Counter()
            blocks = list(self._pairs(mine, held, dtype, counts, biased, joinable, varlen))
            calls = any(b.varlen is not None for b in blocks)
            self._steps[key] = (blocks, tuple((v.value, n) for v, n in counts.items()), calls)
        blocks, counts, calls = self._steps[key]
        if count:
            for seen, n in counts:
                self._counts[seen] += n
        moved = self._varlen_on_device(key, blocks) if calls else {}
        for i, b in enumerate(blocks):
            if b.varlen is not None:
                yield moved[i]
            elif b.seen is Visibility.MASKED:
                yield self._biased(b, dtype)
            else:
                yield b

    def _pairs(self, mine, held, dtype, counts: Counter | None, biased, joinable, varlen):
        """``pairs``, counting each pair's visibility into ``counts`` (if not None); under a
        program, its masked blocks carry no bias yet."""
        whole: dict[tuple[int, int], Block] = {}
        varlen_blocks: list[Block] = []
        for i, k_tile in enumerate(held):
            keys = self.keys(k_tile)
            if keys <= 0:
                continue
            for a, q_tile in enumerate(mine):
                seen, bias = self._settled_pair(q_tile, k_tile, keys, dtype, biased)
                calls = (
                    self._varlen_calls(q_tile, k_tile, keys) if varlen and seen is None else None
                )
                if calls is not None:  # open: as FA2 varlen calls
                    varlen_blocks += _varlen_blocks(i, q_tile, k_tile, calls)
                    if counts is not None:
                        counts[Visibility.MASKED if calls else Visibility.HIDDEN] += 1
                    continue
                if seen is None:  # open: block by block, each bias freed after its use
                    seen_blocks = set()
                    for block in self._blocks(i, q_tile, k_tile, keys, biased):
                        seen_blocks.add(block.seen)
                        if _whole(block, q_tile, k_tile):
                            whole[a, i] = block
                        elif block.seen is not Visibility.HIDDEN:
                            yield block
                    if counts is not None:  # the pair's: its blocks' if they agree, else masked
                        one = len(seen_blocks) == 1
                        counts[seen_blocks.pop() if one else Visibility.MASKED] += 1
                    continue
                if counts is not None:
                    counts[seen] += 1
                if seen is not Visibility.HIDDEN:
                    at = (q_tile.positions(q_tile.length), k_tile.positions(keys))
                    block = Block(i, q_tile.rows, slice(0, keys), seen, bias, at)
                    if _whole(block, q_tile, k_tile):
                        whole[a, i] = block
                    else:
                        yield block
        rows_joined = self._queries is self.home
        if varlen_blocks and all(map(_square_causal, whole.values())):  # join them as sequences
            varlen_blocks += [as_varlen(b) for b in whole.values()]
            whole = {}
        if whole:
            calls = joined(whole, mine, held, rows_joined, joinable)
            # HF's padded causal call as one sequence, moved once per step (with a program)
            yield from cut_causal_as_varlen(calls) if varlen and self.program else calls
        yield from joined_varlen(varlen_blocks, held, rows_joined, joinable)

    def _settled_pair(self, q_tile: Tile, k_tile: Tile, keys: int, dtype: torch.dtype, biased):
        """``(visibility, bias)`` of a pair, or ``(None, None)`` if a program leaves it open."""
        qi, ki = self._index[q_tile.key], self._index[k_tile.key]
        if not self._maybe_list[qi][ki]:
            return Visibility.HIDDEN, None
        if self.program is None:
            seen = visibility(q_tile, k_tile, self.is_causal)
            if self.mask is None:
                return seen, None
            return seen, additive_mask(tile_of(self.mask, q_tile.rows, k_tile, keys), dtype)
        if self._full[qi][ki] and not biased:
            return Visibility.FULL, None
        return None, None

    def _blocks(self, held: int, q_tile: Tile, k_tile: Tile, keys: int, biased: bool):
        """Every ``Block`` of an open pair, its visibility from the host's classification
        (made once per plan); one that needs its mask is MASKED, its bias added by ``pairs``
        in each call. Without a bias, blocks run as few calls (``open_blocks.coalesced``)."""
        blocks, coalesced, _ = self._open_blocks(q_tile, k_tile, keys)
        for rows, cols, seen, at, empty in blocks if biased else coalesced:
            if seen is Visibility.HIDDEN or not (seen is Visibility.MASKED or biased):
                yield Block(held, rows, cols, seen, None, at)
                continue
            yield Block(held, rows, cols, Visibility.MASKED, None, at, empty or biased)

    def _biased(self, block: Block, dtype: torch.dtype) -> Block:
        """A program's masked block with its mask as a bias in ``dtype`` on the call's device:
        kept from an earlier call of the step, or evaluated (and kept, within the step's
        budget)."""
        at = block.at
        key = (at[0].start, at[0].stop, at[1].start, at[1].stop, dtype)
        biased = None if self._kept is None else self._kept.get(key)
        if biased is None:
            mask = evaluate(self.program, self._run_inputs, *at, self._device)
            biased = dataclasses.replace(block, bias=additive_mask(mask, dtype))
            if self._kept is not None:
                self._kept.keep(key, biased, biased.bias.numel() * biased.bias.element_size())
        return biased

    def _varlen_on_device(self, step: tuple, blocks: list[Block]) -> dict[int, Block]:
        """The step's varlen blocks (by index) with their sequences on the call's device: kept
        from an earlier call of the step, or copied there, all in one host-to-device copy."""
        key = ("varlen", step)
        moved = None if self._kept is None else self._kept.get(key)
        if moved is None:
            at = [i for i, b in enumerate(blocks) if b.varlen is not None]
            if not at:
                return {}
            host = [blocks[i].varlen.cu for i in at]
            device = torch.cat(host, 1).to(self._device, non_blocking=True)
            cus = device.split([cu.shape[1] for cu in host], 1)
            moved = {
                i: dataclasses.replace(b, varlen=dataclasses.replace(b.varlen, cu=cu))
                for i, b, cu in zip(at, (blocks[i] for i in at), cus, strict=True)
            }
            if self._kept is not None:
                self._kept.keep(key, moved, device.numel() * device.element_size())
        return moved

    def _varlen_calls(self, q_tile: Tile, k_tile: Tile, keys: int) -> list[VarlenCall] | None:
        """An open pair's FA2 varlen calls, where the plan worked them out and they are fewer
        calls than its coalesced blocks or spare a bias; None where its blocks run as well
        (one unmasked call, which may join the step's others: HF's causal mask)."""
        _, coalesced, calls = self._open_blocks(q_tile, k_tile, keys)
        runs = [b for b in coalesced if b.seen is not Visibility.HIDDEN]
        masked = any(b.seen is Visibility.MASKED for b in runs)
        return calls if calls is not None and (masked or len(calls) < len(runs)) else None

    def _open_blocks(self, q_tile: Tile, k_tile: Tile, keys: int) -> tuple[list, list, list]:
        """``(query rows, key rows, visibility, global positions)`` of each block of an open
        pair, classified on the host once and kept for every later call of the plan: each
        block, the blocks coalesced, and (where ``varlen``) the pair as FA2 varlen calls or
        None."""
        key = (q_tile.key, q_tile.rows.start, k_tile.key, keys)
        if key in self._open:
            return self._open[key]
        step = MIN_TILE_ROWS
        q_blocks = [
            Tile(slice(q_tile.rows.start + a, q_tile.rows.start + min(a + step, q_tile.length)),
                 (0, 0), q_tile.start + a)
            for a in range(0, q_tile.length, step)
        ]  # fmt: skip
        k_blocks = [
            Tile(slice(b, min(b + step, keys)), (0, 0), k_tile.start + b)
            for b in range(0, keys, step)
        ]
        hidden, full = settled_pairs(self.program, self.inputs, q_blocks, k_blocks, self.key_len)
        hidden, full = hidden.tolist(), full.tolist()  # host tensors: no device read
        spans = RowSpans(q_tile.length) if self.varlen else None  # each row's run of keys
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
                mask = evaluate(self.program, self.inputs, *at, _HOST)
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
        self._open[key] = (blocks, coalesced(grid, q_tile, k_tile, nominal), calls)
        return self._open[key]


def _varlen_blocks(held: int, q_tile: Tile, k_tile: Tile, calls: list[VarlenCall]) -> list:
    """An open pair's varlen calls as blocks (rows of the shard, key rows of the held tile)."""
    blocks = []
    for call in calls:
        rows = slice(q_tile.rows.start + call.rows.start, q_tile.rows.start + call.rows.stop)
        at = (slice(q_tile.start + call.rows.start, q_tile.start + call.rows.stop),
              slice(k_tile.start + call.cols.start, k_tile.start + call.cols.stop))  # fmt: skip
        blocks.append(
            Block(held, rows, call.cols, Visibility.MASKED, None, at, False, 1, call.varlen)
        )
    return blocks


def _square_causal(block: Block) -> bool:
    n = block.rows.stop - block.rows.start
    return block.seen is Visibility.DIAGONAL and block.cols == slice(0, n)


def _whole(block: Block, q_tile: Tile, k_tile: Tile) -> bool:
    """Whether ``block`` is its whole pair, run with no mask (so it may join others); its
    last keys may be cut off (padding no query of the pair sees: ``calls.joined``)."""
    unmasked = block.bias is None and block.seen in (Visibility.FULL, Visibility.DIAGONAL)
    return unmasked and block.cols.start == 0 and block.rows == q_tile.rows


def tile_of(mask: torch.Tensor, rows: slice, k_tile: Tile, keys: int) -> torch.Tensor:
    """``mask`` (or its gradient) viewed as 4-D, at one tile pair's rows and key columns
    (a size-1 query or key dim stays a broadcast); a view, to read or to add into."""
    mask = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
    q_part = rows if mask.shape[2] > 1 else slice(None)
    k_part = slice(k_tile.start, k_tile.start + keys) if mask.shape[3] > 1 else slice(None)
    return mask[:, :, q_part, k_part]
