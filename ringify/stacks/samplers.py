"""Samplers that give every rank of a ring the same batch."""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import Sampler


class RingSampler(Sampler[int]):
    """``sampler``'s indices, each batch of ``batch_size`` repeated ``ring_size`` times in a
    row: a loader that deals batches to the processes in turn (HF Trainer, accelerate)
    then hands every rank of a ring the same batch and each ring its own, when the rings'
    ranks are consecutive (the inner dim of a ``(dp, cp)`` mesh). An incomplete last
    batch is dropped: it would be split between ranks of one ring.

    HF Trainer: ``def _get_train_sampler(self, *a): return RingSampler(
    super()._get_train_sampler(*a), self.args.per_device_train_batch_size, ring_size)``.
    """

    def __init__(self, sampler: Sampler[int], batch_size: int, ring_size: int):
        if batch_size < 1 or ring_size < 1:
            raise ValueError(
                f"batch_size and ring_size must be >= 1, got {batch_size} and {ring_size}"
            )
        self.sampler, self.batch_size, self.ring_size = sampler, batch_size, ring_size

    def __iter__(self) -> Iterator[int]:
        batch = []
        for index in self.sampler:
            batch.append(index)
            if len(batch) == self.batch_size:
                for _ in range(self.ring_size):
                    yield from batch
                batch = []

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size * self.batch_size * self.ring_size
