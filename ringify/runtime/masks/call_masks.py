"""One ring call's tile masks: the plan's blocks, with what the call adds on its device.

``TileMasks`` decides on the host, once per plan, which blocks each step runs; a
``CallMasks`` binds those answers to one call: the program's inputs as the call holds them,
its device, the step's masks (``step_layout.GivenMasks``: made once per step by
``ringify::step_masks``) and the plan's pair counts. Under a program it gives each masked
block its bias and each varlen call its sequences on the device: from the step's masks, or,
for what they lack, made in the call. Nothing here reads a device tensor on the host.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch

from ringify.runtime.masks.additive import additive_mask
from ringify.runtime.masks.calls import Block
from ringify.runtime.masks.program import MaskProgram, evaluate
from ringify.runtime.masks.step_layout import GivenMasks, block_key
from ringify.runtime.masks.tile_masks import Step, TileMasks
from ringify.runtime.tiling.tiles import Tile, Visibility


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
