"""One ring call's tile masks: the plan's blocks, with what the call adds on its device.

``TileMasks`` decides on the host, once per plan, which blocks each step runs; a
``CallMasks`` binds those answers to one call: the program's inputs as the call holds them,
its device, the step's kept masks (``step_masks.KeptMasks``) and the plan's pair counts.
Under a program it gives each masked block its bias and each varlen call its sequences on
the device, reusing what an earlier call of the step kept. Nothing here reads a device
tensor on the host.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch

from ringify.runtime.masks.additive import additive_mask
from ringify.runtime.masks.calls import Block
from ringify.runtime.masks.program import MaskProgram, evaluate
from ringify.runtime.masks.step_masks import KeptMasks
from ringify.runtime.masks.tile_masks import Step, TileMasks
from ringify.runtime.tiling.tiles import Tile, Visibility


class CallMasks:
    """``masks``' blocks for a call on ``device`` whose program inputs are ``inputs``; the
    pairs it sees counted into ``counts`` (by each ``Visibility``'s value). (An op's body
    runs below autograd: nothing computed here from ``inputs`` is recorded.) ``varlen``:
    whether open pairs may run as FA2 varlen calls (not in a CUDA graph's recording)."""

    def __init__(
        self, masks: TileMasks, inputs: list[torch.Tensor], device: torch.device,
        kept: KeptMasks | None, counts: Counter, varlen: bool = True,
    ) -> None:  # fmt: skip
        self.masks, self.inputs, self.device = masks, inputs, device
        self.kept, self.counts, self.varlen = kept, counts, varlen

    @property
    def program(self) -> MaskProgram | None:
        return self.masks.program

    def skip(self, mine: list[Tile], held: int) -> None:
        """Count the pairs of a step at which the held tiles did not come: all hidden."""
        self.counts[Visibility.HIDDEN.value] += len(mine) * held

    def pairs(
        self, mine, held, dtype: torch.dtype, count: bool = False, biased: bool = False,
        joinable: bool = False, varlen: bool = False,
    ):  # fmt: skip
        """Every ``Block`` with work at a step (``TileMasks.step_blocks``): a mask tensor's
        with their biases (the call's own, made as they are used); a program's from the
        step's blocks, the masked ones with their bias and the varlen calls with their
        sequences on the device. ``count``: the pairs are counted (a forward call)."""
        masks, varlen = self.masks, varlen and self.varlen
        if masks.mask is not None:  # a mask tensor: the call's own, biases and all
            counts: Counter = Counter()
            yield from masks.blocks(mine, held, dtype, counts, biased, joinable, False)
            if count:
                self.counts.update({seen.value: n for seen, n in counts.items()})
            return
        step = masks.step_blocks(mine, held, dtype, biased, joinable, varlen and not biased)
        if count:
            for seen, n in step.counts:
                self.counts[seen] += n
        moved = self._varlen_on_device(step) if step.varlen else {}
        for i, b in enumerate(step.blocks):
            if b.varlen is not None:
                yield moved[i]
            elif b.seen is Visibility.MASKED:
                yield self._biased(b, dtype)
            else:
                yield b

    def _biased(self, block: Block, dtype: torch.dtype) -> Block:
        """A program's masked block with its mask as a bias in ``dtype`` on the call's device:
        kept from an earlier call of the step, or evaluated (and kept, within the step's
        budget)."""
        at = block.at
        key = (at[0].start, at[0].stop, at[1].start, at[1].stop, dtype)
        biased = None if self.kept is None else self.kept.get(key)
        if biased is None:
            mask = evaluate(self.masks.program, self.inputs, *at, self.device)
            biased = dataclasses.replace(block, bias=additive_mask(mask, dtype))
            if self.kept is not None:
                self.kept.keep(key, biased, biased.bias.numel() * biased.bias.element_size())
        return biased

    def _varlen_on_device(self, step: Step) -> dict[int, Block]:
        """The step's varlen blocks (by index) with their sequences on the call's device: kept
        from an earlier call of the step, or copied there, all in one host-to-device copy."""
        key = ("varlen", step.key)
        moved = None if self.kept is None else self.kept.get(key)
        if moved is None:
            blocks = step.blocks
            at = [i for i, b in enumerate(blocks) if b.varlen is not None]
            host = [blocks[i].varlen.cu for i in at]
            device = torch.cat(host, 1).to(self.device, non_blocking=True)
            cus = device.split([cu.shape[1] for cu in host], 1)
            moved = {
                i: dataclasses.replace(b, varlen=dataclasses.replace(b.varlen, cu=cu))
                for i, b, cu in zip(at, (blocks[i] for i in at), cus, strict=True)
            }
            if self.kept is not None:
                self.kept.keep(key, moved, device.numel() * device.element_size())
        return moved
