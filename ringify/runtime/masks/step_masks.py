"""The masks of a step's masked blocks: evaluated once on the device, reused by every layer.

A block that a program leaves partly visible runs with its mask as a bias. Evaluated in
each call, that is a dozen kernel launches per block in every layer's forward, backward
and recompute, though every layer of the step asks for the same mask (the same program
and inputs: one plan). FlexAttention evaluates its ``mask_mod`` inside the kernel;
the kernels here take a bias, so the first call of a step keeps each mask it evaluates,
on its device, for the later calls of the step: the kept masks live on the step's plan
(``masks/plan.py``), which the graph frees after the step's backward.

A block is kept with its bias, ready for the kernel, at most ``KEPT_BYTES_PER_ROW`` bytes
per query row of the rank: O(S x block) per rank, as a sliding window's or a document
boundary's masked blocks need; blocks beyond the budget are evaluated in each call. On the
CPU none are kept (``kept_bytes_per_row``).
"""

from __future__ import annotations

from typing import Any

from ringify.runtime.tiling import tiles

# Per query row: a bf16 bias 4096 keys wide (a GPU tile pair's masked call, its widest).
KEPT_BYTES_PER_ROW = 8 * 1024


def kept_bytes_per_row(device_type: str) -> int:
    """On the CPU nothing is kept: a block's kernel there costs far more than evaluating its
    mask, and memory is what a CPU run is short of. On accelerators, ``KEPT_BYTES_PER_ROW``."""
    return KEPT_BYTES_PER_ROW if tiles.on_accelerator(device_type) else 0


class KeptMasks:
    """One step's masked blocks on one device, each with its bias (the kernels' additive
    mask, made once: no call of the step launches it again) or its varlen sequences, by the
    block's global positions and the bias dtype, within a byte budget."""

    def __init__(self, budget: int):
        self.budget, self.bytes = budget, 0
        self._blocks: dict[tuple, Any] = {}

    def get(self, key: tuple) -> Any:
        return self._blocks.get(key)

    def keep(self, key: tuple, block: Any, size: int) -> None:
        """Keep ``block`` if its ``size`` bytes on the device fit in the budget."""
        if self.bytes + size <= self.budget:
            self._blocks[key] = block
            self.bytes += size

    def __len__(self) -> int:
        return len(self._blocks)
