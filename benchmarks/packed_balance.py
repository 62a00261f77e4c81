"""How evenly packed documents of uneven length spread attention work over a ring.

    python benchmarks/packed_balance.py --seq 131072 --rings 2 4 8

Under a causal mask that restarts at every document, a rank's work is what its query
rows see. Zigzag balances one document exactly; packed documents of uneven length
need not be. For each document mix and ring size this prints, as max / mean over the
ranks (1.0 = balanced):
- ``ideal``: visible (query, key) pairs per rank, the work of an exact kernel;
- ``op``: the area of the kernel calls the ring op makes (its blocks that are not
  skipped, a causal block counting half), read from the op's own tile masks;
- ``per-doc``: visible pairs if every document were cut into 2P pieces, rank r taking
  pieces r and 2P-1-r (torch's ``_PerDocumentHeadTailLoadBalancer``).
No communication: the tile masks are the same on every rank, so one process plays all.
"""

from __future__ import annotations

import argparse
import sys

import torch
from tabulate import tabulate

from ringify.runtime.layout import padded_length, rank_chunks
from ringify.runtime.mask_program import MaskProgram
from ringify.runtime.schedule import shard_tiles
from ringify.runtime.tile_masks import TileMasks, program_tiles_per_chunk
from ringify.runtime.tiles import Visibility, sub_ring_tiles

# document ids equal, key at or before query: HF's packed-sequence mask
_DOCUMENT_CAUSAL = MaskProgram(
    ("q", "k"),
    (
        ("eq.Tensor", ({"in": 0}, {"in": 1}), "bool"),
        ("le.Tensor", ({"pos": "k"}, {"pos": "q"}), "bool"),
        ("__and__.Tensor", ({"op": 0}, {"op": 1}), "bool"),
    ),
).text()


def document_mixes(seq: int) -> dict[str, list[int]]:
    """Document lengths of each mix (summing to ``seq``)."""
    g = torch.Generator().manual_seed(0)
    lognormal = torch.exp(torch.randn(200, generator=g))  # 200 documents, a long tail
    return {
        "one document": [seq],
        "4 docs: 10/20/30/40%": _lengths([0.1, 0.2, 0.3, 0.4], seq),
        "2 docs: 90/10%": _lengths([0.9, 0.1], seq),
        "50% + 32 short": _lengths([0.5] + [0.5 / 32] * 32, seq),
        "200 docs, log-normal": _lengths((lognormal / lognormal.sum()).tolist(), seq),
    }


def _lengths(fractions: list[float], seq: int) -> list[int]:
    cuts = [round(sum(fractions[: i + 1]) * seq) for i in range(len(fractions))]
    return [b - a for a, b in zip([0, *cuts[:-1]], cuts, strict=True) if b > a]


def _imbalance(work: list[float]) -> float:
    return round(max(work) / (sum(work) / len(work)), 3)


def ideal(lengths: list[int], ring: int) -> list[float]:
    """Visible pairs per rank under zigzag: a row at offset i of its document sees i + 1."""
    per_row = torch.cat([torch.arange(1, n + 1, dtype=torch.float64) for n in lengths])
    chunks = per_row.view(2 * ring, -1).sum(1)
    return [float(sum(chunks[c] for c in rank_chunks(r, ring, "zigzag"))) for r in range(ring)]


def per_document(lengths: list[int], ring: int) -> list[float]:
    work = [0.0] * ring
    for n in lengths:
        per_row = torch.arange(1, n + 1, dtype=torch.float64)
        pieces = per_row.tensor_split(2 * ring)
        for r in range(ring):
            work[r] += float(sum(pieces[c].sum() for c in rank_chunks(r, ring, "zigzag")))
    return work


def op_area(lengths: list[int], ring: int) -> list[float]:
    """The area of the ring op's kernel calls per rank, from its tile masks."""
    seq = sum(lengths)
    docs = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])
    inputs = [docs.view(-1, 1), docs.view(1, -1)]
    rows = padded_length(seq, ring, "zigzag") // ring
    per_chunk = program_tiles_per_chunk(_DOCUMENT_CAUSAL, inputs, rows, ring, "zigzag")

    def tiling(rank: int):
        return shard_tiles(rank, ring, rows, "zigzag", True, per_chunk)

    masks = TileMasks(tiling, ring, None, False, seq, _DOCUMENT_CAUSAL, inputs, "cpu")
    work = []
    for rank in range(ring):
        area, mine = 0.0, tiling(rank)
        for j in sorted({t.sub_ring for t in mine}):
            for step in range(ring):
                held = sub_ring_tiles(tiling((rank - step) % ring), j)
                for b in masks.pairs(mine, held, torch.float32):
                    cells = (b.rows.stop - b.rows.start) * (b.cols.stop - b.cols.start)
                    area += cells / 2 if b.seen is Visibility.DIAGONAL else cells
        work.append(area)
    return work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--rings", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    rows = []
    for name, lengths in document_mixes(args.seq).items():
        for ring in args.rings:
            rows.append({
                "documents": name,
                "P": ring,
                "ideal (max / mean)": _imbalance(ideal(lengths, ring)),
                "op (max / mean)": _imbalance(op_area(lengths, ring)),
                "per-doc (max / mean)": _imbalance(per_document(lengths, ring)),
            })  # fmt: skip
            print(rows[-1], flush=True)
    print(f"Command: python {' '.join(sys.argv)}")
    print(tabulate(rows, headers="keys", tablefmt="github"))


if __name__ == "__main__":
    main()
