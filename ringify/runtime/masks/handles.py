"""A map keyed by a plan handle's identity, holding it weakly.

Every ring call of a step looks its plan and its kept masks up by the handle tensor the
graph gave it (``masks/plan.py``). ``torch.utils.weak.WeakIdKeyDictionary`` does that, but
builds a Python reference object per lookup; here a lookup is a dict get and one call of
a C weakref. An entry lives as long as its handle: when the graph frees the handle after
the step's backward, the entry (a plan's kept masks, O(S x block) on the device) goes too.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


class HandleMap:
    """``{handle tensor: value}`` by identity, weakly keyed."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, Any]] = {}

    def get(self, handle: torch.Tensor, default: Any = None) -> Any:
        entry = self._entries.get(id(handle))
        return entry[1] if entry is not None and entry[0]() is handle else default

    def __setitem__(self, handle: torch.Tensor, value: Any) -> None:
        key = id(handle)

        def forget(ref: weakref.ref, entries=self._entries) -> None:
            if entries.get(key, (None,))[0] is ref:  # not a later handle given the same id
                del entries[key]

        self._entries[key] = (weakref.ref(handle, forget), value)

    def __len__(self) -> int:
        return len(self._entries)
