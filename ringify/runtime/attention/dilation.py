"""LongNet dilated attention: the ``Dilation`` pattern and its single-device definition.

For each pair (w, r) of a ``Dilation``, with w taken as min(w, S): the sequence is
cut into segments of w tokens; inside each segment, head h keeps the positions
whose offset from the segment start is congruent to ``h % r`` modulo r; each kept
query attends to the kept keys of its own segment (those at or before it when
causal). The pairs' outputs are merged with weights proportional to their softmax
denominators (a log-sum-exp merge). A row no pair keeps is zero. The single pair
(S, 1) is dense attention.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Dilation:
    """LongNet's (segment length, dilation rate) pairs; validated on construction."""

    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "segment_lengths", tuple(self.segment_lengths))
        object.__setattr__(self, "dilation_rates", tuple(self.dilation_rates))
        w, r = self.segment_lengths, self.dilation_rates
        if not w or len(w) != len(r):
            raise ValueError(
                f"Dilation needs one dilation rate per segment length (and at least one pair); "
                f"got segment_lengths={w}, dilation_rates={r}"
            )
        for seg, rate in zip(w, r, strict=True):
            if not (isinstance(seg, int) and isinstance(rate, int)) or seg < 1 or rate < 1:
                raise ValueError(
                    f"segment lengths and rates must be positive ints; got ({seg}, {rate})"
                )
            if seg % rate:
                raise ValueError(
                    f"dilation rate {rate} does not divide segment length {seg}: every segment "
                    "must keep the same number of positions per head"
                )

    def pairs(self, seq_len: int) -> list[tuple[int, int]]:
        """The (w, r) pairs for a sequence of ``seq_len``, with w capped at ``seq_len``."""
        return [
            (min(w, seq_len), r)
            for w, r in zip(self.segment_lengths, self.dilation_rates, strict=True)
        ]

    def check_layout(self, layout: str) -> None:
        """Dilated attention needs ``contiguous``: its segments are runs of consecutive positions."""
        if layout != "contiguous":
            raise ValueError(
                f"dilated attention needs layout='contiguous' (got {layout!r}): its segments are "
                "runs of consecutive positions, which zigzag chunks cut apart"
            )

    def check_ring(self, rows: int, ring_size: int, layout: str) -> None:
        """Raise unless the segments and the ring's chunks of ``rows`` per rank line up."""
        self.check_layout(layout)
        seq = rows * ring_size
        self.check_length(seq)
        for w, rate in self.pairs(seq):
            if w <= rows and rows % w:
                raise ValueError(
                    f"segment length {w} does not divide the {rows} rows each rank holds; "
                    f"use a sequence length for which every segment fits whole in a rank's chunk "
                    f"or spans whole chunks"
                )
            if w > rows and (w % rows or rows % rate):
                raise ValueError(
                    f"segment length {w} spans ranks but is not a multiple of the {rows} rows each "
                    f"rank holds (or rate {rate} does not divide them); pick a sequence length "
                    "whose chunks divide the long segments and are divisible by their rates"
                )

    def check_length(self, seq_len: int) -> None:
        for w, r in self.pairs(seq_len):
            if seq_len % w or w % r:
                raise ValueError(
                    f"sequence length {seq_len} does not split into the dilation's segments: "
                    f"segment length {w} (capped at the sequence) must divide it and be divisible "
                    f"by its rate {r}; pad the sequence to a multiple of {max(self.segment_lengths)}"
                )
