"""``Report``: what the pass did to one traced graph, as tabulate tables."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tabulate import tabulate

from ringify.passes.shard_sequence import InsertedGather, RewrittenAttention


@dataclass(frozen=True)
class Report:
    ring_size: int
    layout: str
    length: int
    padded: int
    rewritten: tuple[RewrittenAttention, ...]
    gathers: tuple[InsertedGather, ...]

    def __str__(self) -> str:
        head = (
            f"ringify: ring of {self.ring_size}, layout {self.layout}, sequence {self.length}"
            + (f" (padded to {self.padded})" if self.padded != self.length else "")
        )
        attn = tabulate([asdict(a) for a in self.rewritten], headers="keys") or "(none)"
        gathers = tabulate([asdict(g) for g in self.gathers], headers="keys") or "(none)"
        return (
            f"{head}\n\nattention rewritten into ring attention:\n{attn}\n\n"
            f"gathers inserted (ops run on the full sequence):\n{gathers}\n"
        )
