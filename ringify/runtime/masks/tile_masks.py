"""What each (query tile, key tile) pair of one ring call sees, whatever the mask's form.

A call has one of: the kernel's ``is_causal``; a mask tensor (sliced per pair); a
mask program (``masks/program.py``), bounded for all pairs at once
(``masks/bounds.py``) and evaluated only for the pairs the bounds leave open, at
one pair's size. Every pair ends up in one ``Visibility``: skipped, run with the
kernel's causal mask, with no mask, or with its tile of the mask as a bias.

From the same answers, without evaluating anything, ``last_steps`` says how far
round the ring each rank's key tiles are needed: beyond that step they are not sent
(a sliding window's keys go one rank on, not round the whole ring).

All of it is decided on the host, once per plan. A ``CallMasks`` binds those answers to one
call: the program's inputs as the call holds them, its device, the step's masks
(``step_layout.GivenMasks``: made once per step by ``ringify::step_masks``) and the plan's
pair counts. Under a program it gives each masked block its bias and each varlen call its
sequences on the device: from the step's masks, or, for what they lack, made in the call.
Nothing here reads a device tensor on the host.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from typing import NamedTuple

import torch

from ringify.runtime.masks.bounds import settled_pairs
from ringify.runtime.masks.calls import (
    Block,
    VarlenCall,
    as_varlen,
    cut_causal_as_varlen,
    joined,
    joined_varlen,
)
from ringify.runtime.masks.open_blocks import OpenPair, open_pair
from ringify.runtime.masks.program import MaskProgram, additive_mask, evaluate, parse
from ringify.runtime.tiling.tiles import Tile, Visibility, all_tiles, sub_ring_tiles, visibility


class Step(NamedTuple):
    """A step's blocks under a plan (``TileMasks.step_blocks``), the same in every call:
    its key, its blocks (masked ones with no bias yet), its pairs' count by visibility and
    whether some block is a varlen call."""

    key: tuple
    blocks: list[Block]
    counts: tuple[tuple[int, int], ...]
    varlen: bool


class TileMasks:
    """The visibility of every tile pair of one call (the same on every rank). The key
    tiles of each rank are those of its shard, ``home(rank)``; so are its query tiles
    unless ``working_on`` gives it others (a balanced plan, ``masks/balance.py``).

    A program is bounded and its open blocks classified on the host, from ``inputs``:
    host copies of its inputs (``masks/call_plan.py`` makes them once per model call), so
    that nothing here reads a device tensor or mixes one with a host tensor. The blocks
    that need their mask evaluate it from the inputs of the call they run in, on its
    device (``CallMasks``): device work, no host read."""

    def __init__(
        self, home, ring_size, attn_mask, is_causal, key_len, program, inputs, varlen=False
    ):
        self.home, self._queries, self.ring_size = home, home, ring_size
        self.mask, self.is_causal, self.key_len = attn_mask, is_causal, key_len
        self.program = parse(program) if program else None
        self.varlen = varlen and self.program is not None  # work out open pairs' varlen calls
        self.inputs = [x.detach() for x in inputs]
        # host answers kept for the plan's later calls: open pairs, steps, keys' last steps,
        # and the step masks' layouts (``RingPlan.step_layout``)
        self._open: dict[tuple, OpenPair] = {}
        self._steps: dict[tuple, Step] = {}
        self.layouts: dict[tuple, object] = {}
        tiles = all_tiles(home, ring_size)
        self._index = {t.key: i for i, t in enumerate(tiles)}
        self._maybe = self._maybe_seen(tiles)  # (n, n): could the pair see anything at all
        if self.program is not None:
            hidden, self._full = settled_pairs(self.program, self.inputs, tiles, tiles, key_len)
            self._maybe &= ~hidden
            self._full = self._full.tolist()
        self._maybe_list = self._maybe.tolist()
        self._last: dict[int, list[int]] = {}

    def may_see(self, q_tile: Tile, k_tile: Tile) -> bool:
        """Whether the queries of ``q_tile`` may see a key of ``k_tile`` (else: surely not)."""
        return self._maybe_list[self._index[q_tile.key]][self._index[k_tile.key]]

    def working_on(self, queries) -> TileMasks:
        """These masks with ``queries(rank)`` the query tiles of each rank: the pairs' tables
        and open pairs shared, the steps and the keys' last steps decided anew."""
        moved = copy.copy(self)
        moved._queries, moved._last, moved._steps, moved.layouts = queries, {}, {}, {}
        return moved

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

    def step_blocks(self, mine, held, dtype, biased, joinable, varlen) -> Step:
        """The blocks of a step under a program or none (``blocks``), worked out once and
        kept: the same in every call of the plan (its masked blocks carry no bias yet)."""
        key = (tuple(t.key for t in mine), tuple(t.key for t in held), biased, joinable, varlen)
        if key not in self._steps:
            counts: Counter = Counter()
            blocks = list(self.blocks(mine, held, dtype, counts, biased, joinable, varlen))
            counted = tuple((v.value, n) for v, n in counts.items())
            self._steps[key] = Step(key, blocks, counted, any(b.varlen is not None for b in blocks))
        return self._steps[key]

    def blocks(self, mine, held, dtype, counts: Counter, biased, joinable, varlen):
        """Every ``Block`` with work at a step, each pair's visibility counted into ``counts``.
        A pair is one block, except a pair of a program its bounds leave open: that is cut
        into blocks of ``MIN_TILE_ROWS``, bounded again and evaluated block by block, so that
        most run with no mask or are skipped and no evaluation or bias is larger than a
        block. ``biased``: every block that is not hidden carries its bias, even a zero one
        (a learned program's gradient needs it). The step's unmasked whole pairs come last,
        joined into few calls (``calls.py``; ``joinable``: the held tiles lie side by side in
        memory). ``varlen``: an open pair whose rows each see one run of keys is instead FA2
        varlen calls (``masks/calls.py``), where the plan worked them out (on an
        accelerator); a step's varlen calls, and its square causal pairs with them, join as
        one call's sequences where they run on (``calls.joined_varlen``). A mask tensor's
        blocks carry their biases, made as they are asked for."""
        whole: dict[tuple[int, int], Block] = {}
        varlen_blocks: list[Block] = []
        for i, k_tile in enumerate(held):
            keys = self.keys(k_tile)
            if keys <= 0:
                continue
            for a, q_tile in enumerate(mine):
                seen, pair = self._pair(i, q_tile, k_tile, keys, dtype, biased, varlen)
                counts[seen] += 1
                for block in pair:
                    if block.varlen is not None:
                        varlen_blocks.append(block)
                    elif _whole(block, q_tile, k_tile):
                        whole[a, i] = block
                    elif block.seen is not Visibility.HIDDEN:
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

    def _pair(self, held: int, q_tile: Tile, k_tile: Tile, keys: int, dtype, biased, varlen):
        """``(what the pair counts as, its blocks)``: settled, one block (none if hidden);
        open, its varlen calls or its blocks (masked where they disagree)."""
        seen, bias = self._settled_pair(q_tile, k_tile, keys, dtype, biased)
        if seen is Visibility.HIDDEN:
            return seen, []
        if seen is not None:
            at = (q_tile.positions(q_tile.length), k_tile.positions(keys))
            return seen, [Block(held, q_tile.rows, slice(0, keys), seen, bias, at)]
        calls = self._varlen_calls(q_tile, k_tile, keys) if varlen else None
        if calls is not None:  # open: as FA2 varlen calls
            seen = Visibility.MASKED if calls else Visibility.HIDDEN
            return seen, _varlen_blocks(held, q_tile, k_tile, calls)
        blocks = list(self._blocks(held, q_tile, k_tile, keys, biased))
        kinds = {b.seen for b in blocks}
        return kinds.pop() if len(kinds) == 1 else Visibility.MASKED, blocks

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

    def _varlen_calls(self, q_tile: Tile, k_tile: Tile, keys: int) -> list[VarlenCall] | None:
        """An open pair's FA2 varlen calls, where the plan worked them out and they are fewer
        calls than its coalesced blocks or spare a bias; None where its blocks run as well
        (one unmasked call, which may join the step's others: HF's causal mask)."""
        _, coalesced, calls = self._open_blocks(q_tile, k_tile, keys)
        runs = [b for b in coalesced if b.seen is not Visibility.HIDDEN]
        masked = any(b.seen is Visibility.MASKED for b in runs)
        return calls if calls is not None and (masked or len(calls) < len(runs)) else None

    def _open_blocks(self, q_tile: Tile, k_tile: Tile, keys: int) -> OpenPair:
        """An open pair classified on the host (``open_blocks.open_pair``), once per plan."""
        key = (q_tile.key, q_tile.rows.start, k_tile.key, keys)
        if key not in self._open:
            args = (self.program, self.inputs, self.key_len, q_tile, k_tile, keys, self.varlen)
            self._open[key] = open_pair(*args)
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


def block_key(block: Block) -> tuple[int, int, int, int]:
    rows, cols = block.at
    return rows.start, rows.stop, cols.start, cols.stop


def tile_of(mask: torch.Tensor, rows: slice, k_tile: Tile, keys: int) -> torch.Tensor:
    """``mask`` (or its gradient) viewed as 4-D, at one tile pair's rows and key columns
    (a size-1 query or key dim stays a broadcast); a view, to read or to add into."""
    mask = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
    q_part = rows if mask.shape[2] > 1 else slice(None)
    k_part = slice(k_tile.start, k_tile.start + keys) if mask.shape[3] > 1 else slice(None)
    return mask[:, :, q_part, k_part]


class CallMasks:
    """``masks``' blocks for a call on ``device`` whose program inputs are ``inputs`` and
    whose step's masks are ``given`` (or None), its biases in ``dtype`` and its open pairs
    run as FA2 varlen calls where ``varlen``; the pairs it sees counted into ``counts`` (by
    each ``Visibility``'s value). (An op's body runs below autograd: nothing computed here
    from ``inputs`` is recorded.) ``copies``: whether the call may copy varlen sequences
    from the host (not in a CUDA graph's recording). ``heads``: ``(i, n)``, the call attends
    with the i-th of n shares of the heads (an all-to-all's): a mask that differs per head is
    cut to it."""

    def __init__(
        self, masks: TileMasks, inputs: list[torch.Tensor], device: torch.device,
        dtype: torch.dtype, varlen: bool, given, counts: Counter,
        copies: bool = True, heads: tuple[int, int] = (0, 1),
    ) -> None:  # fmt: skip
        self.masks, self.inputs, self.device = masks, inputs, device
        self.dtype, self.varlen, self.given = dtype, varlen, given
        self.counts, self.copies, self.heads = counts, copies, heads
        self.mask_heads = 1  # the heads a program's mask has (``_biased`` reads them)

    @property
    def program(self) -> MaskProgram | None:
        return self.masks.program

    def skip(self, mine: list[Tile], held: int) -> None:
        """Count the pairs of a step at which the held tiles did not come: all hidden."""
        self.counts[Visibility.HIDDEN.value] += len(mine) * held

    def pairs(self, mine, held, count: bool = False, biased: bool = False, joinable: bool = False):
        """Every ``Block`` with work at a step (``TileMasks.step_blocks``): a mask tensor's
        with their biases (the call's own, made as they are used); a program's from the
        step's blocks, the masked ones with their bias and the varlen calls with their
        sequences on the device. ``count``: the pairs are counted (a forward call)."""
        masks, dtype = self.masks, self.dtype
        if masks.mask is not None:  # a mask tensor: the call's own, biases and all
            counts: Counter = Counter()
            yield from masks.blocks(mine, held, dtype, counts, biased, joinable, False)
            if count:
                self.counts.update({seen.value: n for seen, n in counts.items()})
            return
        step = masks.step_blocks(mine, held, dtype, biased, joinable, self.varlen and not biased)
        sequences = self._sequences(step) if step.varlen else []
        if sequences is None:  # recorded, and the step's masks lack its sequences
            step = masks.step_blocks(mine, held, dtype, biased, joinable, False)
            sequences = []
        if count:
            for seen, n in step.counts:
                self.counts[seen] += n
        sequences = iter(sequences)
        for b in step.blocks:
            if b.varlen is not None:
                yield dataclasses.replace(
                    b, varlen=dataclasses.replace(b.varlen, cu=next(sequences))
                )
            elif b.seen is Visibility.MASKED:
                yield self._biased(b)
            else:
                yield b

    def _biased(self, block: Block) -> Block:
        """A program's masked block with its mask as a bias on the call's device: from the
        step's masks, or evaluated here."""
        bias = None if self.given is None else self.given.bias(block_key(block))
        if bias is None:
            mask = evaluate(self.masks.program, self.inputs, *block.at, self.device)
            i, n = self.heads
            self.mask_heads = mask.shape[1]  # the program's, the same for every block
            if n > 1 and mask.shape[1] > 1:  # a mask per head: this call's share of them
                share = mask.shape[1] // n
                mask = mask[:, i * share : (i + 1) * share]
            bias = additive_mask(mask, self.dtype)
        return dataclasses.replace(block, bias=bias)

    def every_head(self, grad: torch.Tensor) -> torch.Tensor:
        """A block's bias gradient over the call's share of the heads as the program's gradient
        reads it: over every head the program makes (zero beyond the share)."""
        i, n = self.heads
        if n == 1 or self.mask_heads == 1:  # a mask for every head alike: summed over them
            return grad
        every = grad.new_zeros(grad.shape[0], grad.shape[1] * n, *grad.shape[2:])
        every[:, i * grad.shape[1] : (i + 1) * grad.shape[1]] = grad
        return every

    def _sequences(self, step: Step) -> list[torch.Tensor] | None:
        """The ``cu`` of the step's varlen blocks on the call's device: from the step's masks,
        or copied there in one host-to-device copy; None where neither may be."""
        given = None if self.given is None else self.given.step_sequences(step)
        if given is not None or not self.copies:
            return given
        host = [b.varlen.cu for b in step.blocks if b.varlen is not None]
        device = torch.cat(host, 1).to(self.device, non_blocking=True)
        return list(device.split([cu.shape[1] for cu in host], 1))
