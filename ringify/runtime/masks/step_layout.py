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
(``tiles.ring_visits``' order) and asks each for its blocks, as the calls do. The two
tensors have fixed sizes (``Capacity``): ``KEPT_BYTES_PER_ROW`` bytes of biases and
``SEQUENCES_PER_ROW`` sequence columns per query row of the rank, O(S) per rank, so that a
traced graph knows them (sizes that follow from a step's content would be unbacked symbols,
which Inductor does not carry through every graph). A call that asks for what the layout
lacks (beyond the capacity, a learned program's biased backward) makes it itself. On the
CPU nothing is laid out.

``GivenMasks`` is what a ring call reads them from (``tile_masks.CallMasks``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ringify.runtime.masks.program import evaluate
from ringify.runtime.masks.tile_masks import Step, TileMasks, block_key
from ringify.runtime.tiling import tiles
from ringify.runtime.tiling.tiles import Tiling, Visibility, sub_ring, sub_rings

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
