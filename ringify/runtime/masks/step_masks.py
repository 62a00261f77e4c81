"""The masks of a step's masked blocks: evaluated once on the device, reused by every layer.

A block that a program leaves partly visible runs with its mask as a bias. Evaluated in
each call, that is a dozen kernel launches per block in every layer's forward, backward
and recompute, though every layer of the step asks for the same mask (the same program
and inputs: one plan handle). FlexAttention evaluates its ``mask_mod`` inside the kernel;
the kernels here take a bias, so the first call of a step keeps each mask it evaluates,
on its device, for the later calls of the step: the kept masks live as long as the plan
handle (``masks/plan.py``), which the graph frees after the step's backward.

Kept masks are the program's own output (bool for HF's masks), at most ``KEPT_BYTES_PER_ROW``
bytes per query row of the rank: O(S x block) per rank, as a sliding window's or a document
boundary's masked blocks need; blocks beyond the budget are evaluated in each call. On the
CPU none are kept (``kept_bytes_per_row``).
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ringify.runtime.tiling import tiles

# Per query row: a bool mask 8192 keys wide (a window's or a document's edge blocks).
KEPT_BYTES_PER_ROW = 8 * 1024


def kept_bytes_per_row(device_type: str) -> int:
    """On the CPU nothing is kept: a block's kernel there costs far more than evaluating its
    mask, and memory is what a CPU run is short of. On accelerators, ``KEPT_BYTES_PER_ROW``."""
    return KEPT_BYTES_PER_ROW if tiles.on_accelerator(device_type) else 0


_by_handle: WeakIdKeyDictionary = WeakIdKeyDictionary()  # plan handle -> {device: KeptMasks}


class KeptMasks:
    """One step's masks on one device, by the block's global positions, within a byte budget."""

    def __init__(self, budget: int):
        self.budget, self.bytes = budget, 0
        self._masks: dict[tuple[int, int, int, int], torch.Tensor] = {}

    def get(self, key: tuple[int, int, int, int]) -> torch.Tensor | None:
        return self._masks.get(key)

    def keep(self, key: tuple[int, int, int, int], mask: torch.Tensor) -> None:
        size = mask.numel() * mask.element_size()
        if self.bytes + size <= self.budget:
            self._masks[key] = mask
            self.bytes += size

    def __len__(self) -> int:
        return len(self._masks)


def kept_masks(handle: torch.Tensor | None, device: torch.device, rows: int) -> KeptMasks | None:
    """The masks kept for the step of plan ``handle`` on ``device`` (a rank of ``rows`` query
    rows), or None where there is no handle (a call made outside a ringified graph) or
    nothing is kept on the device (``kept_bytes_per_row``)."""
    budget = kept_bytes_per_row(device.type) * rows
    if handle is None or budget == 0:
        return None
    per_device = _by_handle.setdefault(handle, {})
    if device not in per_device:
        per_device[device] = KeptMasks(budget)
    return per_device[device]
