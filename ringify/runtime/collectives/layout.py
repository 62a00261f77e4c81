"""Sequence layouts: which global positions each rank of a ring holds.

- ``contiguous``: the sequence is cut into P equal chunks; rank r holds chunk r,
  positions ``[r*c, (r+1)*c)``.
- ``zigzag``: the sequence is cut into 2P equal chunks; rank r holds chunks
  ``r`` and ``2P-1-r`` (head and tail), concatenated in that order, so that under
  a causal mask every rank does the same amount of work.
"""

from __future__ import annotations

import torch

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def chunks_per_rank(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def rank_chunks(rank: int, ring_size: int, layout: str) -> tuple[int, ...]:
    """The global chunk indices rank ``rank`` holds, in local order."""
    if layout == "zigzag":
        return (rank, 2 * ring_size - 1 - rank)
    return (rank,)


def split_multiple(ring_size: int, layout: str) -> int:
    """What a sequence length must be a multiple of to split into the layout's equal chunks."""
    return ring_size * chunks_per_rank(layout)


def padded_length(seq_len: int, ring_size: int, layout: str) -> int:
    """The smallest length >= ``seq_len`` that splits into the layout's equal chunks."""
    n = split_multiple(ring_size, layout)
    return -(-seq_len // n) * n


def check_splittable(seq_len: int, ring_size: int, layout: str, what: str = "sequence") -> None:
    """Raise unless ``seq_len`` positions split into the layout's equal chunks."""
    n = split_multiple(ring_size, layout)
    if seq_len % n:
        lower, upper = seq_len - seq_len % n, seq_len + n - seq_len % n
        raise ValueError(
            f"{what} length {seq_len} does not split into {n} equal chunks "
            f"(ring size {ring_size}, layout {layout!r}); pad or trim it to a multiple of {n} "
            f"(e.g. {lower} or {upper})"
        )


def shard_for_rank(
    x: torch.Tensor, dim: int, rank: int, ring_size: int, layout: str
) -> torch.Tensor:
    """Rank ``rank``'s part of the full tensor ``x`` along ``dim`` (a view where possible)."""
    check_layout(layout)
    check_splittable(x.shape[dim], ring_size, layout)
    chunk = x.shape[dim] // split_multiple(ring_size, layout)
    parts = [x.narrow(dim, i * chunk, chunk) for i in rank_chunks(rank, ring_size, layout)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def unshard(parts: list[torch.Tensor], dim: int, layout: str) -> torch.Tensor:
    """The full tensor from every rank's part (``parts[r]`` from rank r), in global order."""
    check_layout(layout)
    if layout == "contiguous":
        return torch.cat(parts, dim)
    halves = [p.chunk(2, dim) for p in parts]
    heads = [h[0] for h in halves]
    tails = [h[1] for h in reversed(halves)]
    return torch.cat(heads + tails, dim)
