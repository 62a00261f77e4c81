"""This rank's part of a KV cache that stays split across the ring while tokens are decoded.

After the ringified prefill each rank holds its chunks of every layer's K/V (the
layout's, e.g. zigzag) and knows their global positions. Each decoded token's K/V are
stored on one rank: the one holding the fewest entries (the lowest such rank on a tie),
which every rank computes alike, so that the parts stay within one entry of each other.

Room for this rank's share of the new tokens is reserved once, layer by layer as the
prefill's tensors are released (at most one layer's part is held twice, briefly), so
that a step writes its entry in place rather than copying the cache. What a step reads
(``keys``, ``values``, ``positions``) are views of exactly the entries held.
"""

from __future__ import annotations

import torch

from ringify.runtime.collectives.ring import Ring


class ShardedCache:
    """Per layer this rank's cached keys and values (B, K, n, D), and their positions.

    ``parts``: the prefill's ``(keys, values)`` per layer (released as they are copied);
    ``positions``: their global positions (n,); ``reserve``: room for this many new tokens
    on this rank; ``length``: the global number of positions cached (every rank's).
    """

    def __init__(self, parts: list, positions: torch.Tensor, ring: Ring, reserve: int, length: int):
        n = positions.numel()
        self.ring, self.filled, self.length = ring, n, length
        self.counts = [n] * ring.size  # every rank's number of entries, known to all
        self._keys, self._values = [], []
        while parts:
            k, v = parts.pop(0)
            for held, x in ((self._keys, k), (self._values, v)):
                b, heads, _, d = x.shape
                buffer = x.new_empty(b, heads, n + reserve, d)
                buffer[:, :, :n].copy_(x)
                held.append(buffer)
            del k, v, x
        self._positions = torch.empty(n + reserve + 1, dtype=torch.long, device=positions.device)
        self._positions[:n].copy_(positions)

    @property
    def layers(self) -> int:
        return len(self._keys)

    def owner(self) -> int:
        """The rank that stores the next token's entries."""
        return min(range(self.ring.size), key=lambda r: (self.counts[r], r))

    def keys(self, layer: int) -> torch.Tensor:
        return self._keys[layer][:, :, : self.filled]

    def values(self, layer: int) -> torch.Tensor:
        return self._values[layer][:, :, : self.filled]

    def positions(self) -> torch.Tensor:
        """This rank's cached positions, then the next token's (``length``)."""
        self._positions[self.filled] = self.length
        return self._positions[: self.filled + 1]

    def append(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Store the next token's (B, K, 1, D) entries of every layer on its owner."""
        owner = self.owner()
        if owner == self.ring.rank:
            if self.filled == self._keys[0].shape[2]:
                raise RuntimeError("ringify: the decode cache's reserved room is used up")
            for held, new in ((self._keys, keys), (self._values, values)):
                for buffer, x in zip(held, new, strict=True):
                    buffer[:, :, self.filled : self.filled + 1].copy_(x)
            self.filled += 1
        self.counts[owner] += 1
        self.length += 1

    def nbytes(self) -> int:
        """The bytes of the entries held (not the reserved room)."""
        return sum(self.keys(i).nbytes + self.values(i).nbytes for i in range(self.layers))

    def as_dynamic_cache(self):
        """The entries held as HF's ``DynamicCache`` (views, no copy)."""
        from transformers import DynamicCache

        cache = DynamicCache(
            [(k[:, :, :0], v[:, :, :0]) for k, v in zip(self._keys, self._values, strict=True)]
        )
        for i, layer in enumerate(cache.layers):
            layer.keys, layer.values = self.keys(i), self.values(i)
        return cache
