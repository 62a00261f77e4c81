"""Where a step's masks lie in the two tensors ``ringify::step_masks`` gives every ring call.

A block that a program leaves partly visible runs with its mask as a bias; an open pair whose
rows each see one run of keys runs as FA2 varlen calls, whose sequences (``cu_seqlens``) are
worked out on the host. Every layer of a step asks for the same masks and sequences (one
plan), so they are made once per step on the device, outside any CUDA graph
(``step_masks.py``), and travel into every ring call as two tensors of the graph, as
FlexAttention's ``BlockMask`` travels into ``flex_attention``:

- ``biases``: every masked block's additive bias, in the kernels' bias dtype, side by side,
  each row padded to 8 elements as CUDA's efficient kernel takes it (``StepLayout.biases``:
  a block's global positions -> its offset and shape);
- ``sequences``: every varlen step's ``cu`` (2, n + 1) side by side along dim 1
  (``StepLayout.sequences``: a step's key -> its blocks' columns).

The layout is a pure function of the plan's host answers, the rank and the calls' bias
dtype and varlen use: ``step_layout`` walks the steps this rank's ring calls will visit
(``schedule.ring_visits``' order) and asks each for its blocks, as the calls do. The two
tensors have fixed sizes (``Capacity``): ``KEPT_BYTES_PER_ROW`` bytes of biases and
``SEQUENCES_PER_ROW`` sequence columns per query row of the rank, O(S) per rank, so that a
traced graph knows them (sizes that follow from a step's content would be unbacked symbols,
which Inductor does not carry through every graph). A call that asks for what the layout
lacks (beyond the capacity, a learned program's biased backward) makes it itself. On the
CPU nothing is laid out.

One ring call's tile masks: the plan's blocks, with what the call adds on its device.

``TileMasks`` decides on the host, once per plan, which blocks each step runs; a
``CallMasks`` binds those answers to one call: the program's inputs as the call holds them,
its device, the step's masks (``step_layout.GivenMasks``: made once per step by
``ringify::step_masks``) and the plan's pair counts. Under a program it gives each masked
block its bias and each varlen call its sequences on the device: from the step's masks, or,
for what they lack, made in the call. Nothing here reads a device tensor on the host.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field

import torch

from ringify.runtime.masks.calls import Block
from ringify.runtime.masks.program import MaskProgram, additive_mask, evaluate
from ringify.runtime.masks.tile_masks import Step, TileMasks
from ringify.runtime.tiling import tiles
from ringify.runtime.tiling.tiles import Tile, Tiling, Visibility, sub_ring, sub_rings

# Per query row: a bf16 bias 4096 keys wide (a GPU tile pair's masked call, its widest).
KEPT_BYTES_PER_ROW = 8 * 1024
# Per query row: varlen sequence boundaries (a document a row, a step's calls ending each).
SEQUENCES_PER_ROW = 4


@dataclass(frozen=True)
class Capacity:
    """The sizes of a step's two tensors for a rank of ``rows`` query rows on ``device_type``:
    bias elements in ``dtype`` and sequence columns. On the CPU none: a block's kernel there
    costs far more than evaluating its mask, and memory is what a CPU run is short of."""

    biases: int
    sequences: int

    @classmethod
    def of(cls, device_type: str, rows: int, dtype: torch.dtype) -> Capacity:
        if not tiles.on_accelerator(device_type):
            return cls(0, 0)
        element = torch.empty((), dtype=dtype).element_size()
        return cls(KEPT_BYTES_PER_ROW * rows // element, SEQUENCES_PER_ROW * rows)


@dataclass(frozen=True)
class StepLayout:
    """Offsets of a step's masked blocks (by global ``(q start, q stop, k start, k stop)``:
    ``(offset, shape)`` in ``biases``) and varlen steps (by ``Step.key``: per varlen block
    of the step, its columns of ``sequences``), the biases' size, and ``sequences`` itself
    on the host (2, columns), int32."""

    dtype: torch.dtype
    biases: dict[tuple, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    sequences: dict[tuple, list[slice]] = field(default_factory=dict)
    bias_numel: int = 0
    host_sequences: torch.Tensor = field(
        default_factory=lambda: torch.zeros(2, 0, dtype=torch.int32)
    )

    @property
    def sequence_cols(self) -> int:
        return self.host_sequences.shape[1]


def block_key(block: Block) -> tuple[int, int, int, int]:
    rows, cols = block.at
    return rows.start, rows.stop, cols.start, cols.stop


def step_layout(
    masks: TileMasks, home: Tiling, queries: Tiling, rank: int, dtype: torch.dtype,
    varlen: bool, capacity: Capacity,
) -> StepLayout:  # fmt: skip
    """The layout of the masks of rank ``rank``'s ring calls (forward and unbiased backward:
    the same steps) under ``masks``, its shard tiled by ``home`` and its query tiles
    ``queries(rank)``; biases in ``dtype``; ``varlen``: the calls run open pairs as FA2
    varlen calls; within ``capacity``."""
    layout = StepLayout(dtype)
    if masks.program is None or capacity == Capacity(0, 0):
        return layout
    shapes: dict[tuple[int, int], tuple[int, ...]] = {}
    biases, sequences, offset, cus, cols = {}, {}, 0, [], 0
    for step in visited_steps(masks, home, queries, rank, dtype, varlen):
        step_cus = [b.varlen.cu for b in step.blocks if b.varlen is not None]
        widths = [cu.shape[1] for cu in step_cus]
        if step_cus and step.key not in sequences and cols + sum(widths) <= capacity.sequences:
            sequences[step.key] = [slice(cols + a, cols + a + w) for a, w in _starts(widths)]
            cus += step_cus
            cols += sum(widths)
        for b in step.blocks:
            key = block_key(b) if b.seen is Visibility.MASKED and b.varlen is None else None
            if key is None or key in biases:
                continue
            size = (key[1] - key[0], key[3] - key[2])
            if size not in shapes:
                shapes[size] = _bias_shape(masks, size)
            numel = _padded_numel(shapes[size])
            if offset + numel > capacity.biases:
                continue
            biases[key] = (offset, shapes[size])
            offset += numel
    host = torch.cat(cus, 1) if cus else torch.zeros(2, 0, dtype=torch.int32)
    return StepLayout(dtype, biases, sequences, offset, host)


def visited_steps(masks: TileMasks, home: Tiling, queries: Tiling, rank: int, dtype, varlen):
    """Every ``Step`` rank ``rank``'s ring call visits, in its order (``ring_visits``): per
    sub-ring, the steps at which it holds another rank's tiles (or its own)."""
    mine, size = queries(rank), masks.ring_size
    for own in sub_rings(home, rank):
        j = own.tiles[0].sub_ring
        last = masks.last_steps(j)
        for s in range(size):
            src = (rank - s) % size
            if s <= last[src]:
                held = sub_ring(home, src, j).tiles
                joinable = s > 0 or own.adjacent  # received tiles lie side by side
                yield masks.step_blocks(mine, held, dtype, False, joinable, varlen)


def _starts(widths: list[int]):
    start = 0
    for w in widths:
        yield start, w
        start += w


def _padded_numel(shape: tuple[int, ...]) -> int:
    """Elements a bias of ``shape`` takes with its rows padded to 8 (16-byte aligned rows)."""
    return math.prod(shape[:-1]) * (shape[-1] + (-shape[-1] % 8))


def _bias_shape(masks: TileMasks, size: tuple[int, int]) -> tuple[int, ...]:
    """The shape of a block's bias of ``size`` (rows, keys) under the program: 4-D, size 1
    where the mask broadcasts (evaluated on meta tensors: no work)."""
    meta = [x.to("meta") for x in masks.inputs]
    rows, cols = slice(0, size[0]), slice(0, size[1])
    return tuple(evaluate(masks.program, meta, rows, cols, "meta").shape)


@dataclass(frozen=True)
class GivenMasks:
    """A step's two tensors from ``ringify::step_masks`` with their layout: what a ring call
    reads its masked blocks' biases and varlen sequences from."""

    layout: StepLayout
    biases: torch.Tensor
    sequences: torch.Tensor

    def bias(self, key: tuple) -> torch.Tensor | None:
        """The bias of the block at ``key`` (``block_key``), a view of ``biases`` with its rows
        padded, or None where the layout lacks it."""
        found = self.layout.biases.get(key)
        if found is None:
            return None
        offset, shape = found
        *lead, t = shape
        rows = self.biases[offset : offset + _padded_numel(shape)].view(*lead, t + (-t % 8))
        return rows[..., :t]

    def step_sequences(self, step: Step) -> list[torch.Tensor] | None:
        """The ``cu`` of each varlen block of ``step``, views of ``sequences``, or None."""
        found = self.layout.sequences.get(step.key)
        return None if found is None else [self.sequences[:, c] for c in found]


class CallMasks:
    """``masks``' blocks for a call on ``device`` whose program inputs are ``inputs`` and
    whose step's masks are ``given`` (or None), its biases in ``dtype`` and its open pairs
    run as FA2 varlen calls where ``varlen``; the pairs it sees counted into ``counts`` (by
    each ``Visibility``'s value). (An op's body runs below autograd: nothing computed here
    from ``inputs`` is recorded.) ``copies``: whether the call may copy varlen sequences
    from the host (not in a CUDA graph's recording)."""

    def __init__(
        self, masks: TileMasks, inputs: list[torch.Tensor], device: torch.device,
        dtype: torch.dtype, varlen: bool, given: GivenMasks | None, counts: Counter,
        copies: bool = True,
    ) -> None:  # fmt: skip
        self.masks, self.inputs, self.device = masks, inputs, device
        self.dtype, self.varlen, self.given = dtype, varlen, given
        self.counts, self.copies = counts, copies

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
            bias = additive_mask(mask, self.dtype)
        return dataclasses.replace(block, bias=bias)

    def _sequences(self, step: Step) -> list[torch.Tensor] | None:
        """The ``cu`` of the step's varlen blocks on the call's device: from the step's masks,
        or copied there in one host-to-device copy; None where neither may be."""
        given = None if self.given is None else self.given.step_sequences(step)
        if given is not None or not self.copies:
            return given
        host = [b.varlen.cu for b in step.blocks if b.varlen is not None]
        device = torch.cat(host, 1).to(self.device, non_blocking=True)
        return list(device.split([cu.shape[1] for cu in host], 1))
