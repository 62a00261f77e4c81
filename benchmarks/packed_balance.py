"""How evenly packed documents of uneven length spread attention work over a ring, with and
without the ring op's load balancing (``ringify/runtime/masks/balance.py``).

    python benchmarks/packed_balance.py --seq 131072 --rings 2 4 8
    python benchmarks/packed_balance.py --seq 32768 --rings 2 --time

Under a causal mask that restarts at every document, a rank's work is what its query
rows see. Zigzag balances one document exactly; packed documents of uneven length
need not be. For each document mix and ring size this prints, as max / mean over the
ranks (1.0 = balanced):
- ``ideal``: visible (query, key) pairs per rank under zigzag, the work of an exact kernel;
- ``op``: the area of the kernel calls the ring op makes under zigzag (its blocks that
  are not skipped, a causal block counting half), read from the op's own tile masks;
- ``op balanced``: the same on the plan the op runs on (``balanced_tiling``);
- ``per-doc``: visible pairs if every document were cut into 2P pieces, rank r taking
  pieces r and 2P-1-r (torch's ``_PerDocumentHeadTailLoadBalancer``);
- ``modelled``: the op's time model (``ring_time``: a rank starts a step once its
  neighbours have started the one before) over the ideal (all work / P), zigzag ->
  balanced.
No communication: the tile masks are the same on every rank, so one process plays all.
With ``--time`` it also runs the ring op (forward + backward, float32, 4 heads, 2 k/v
heads, head dim 64) on gloo ranks, balanced and not, interleaved, and reports the
slowest rank's best time of each and the bytes each rank sent (rows moved included).
"""

from __future__ import annotations

import argparse
import sys

import torch
from tabulate import tabulate

from ringify.runtime.attention.spec import AttentionSpec
from ringify.runtime.collectives.layout import padded_length, rank_chunks
from ringify.runtime.masks.balance import (
    balanced_tiling,
    ring_time,
    tile_costs,
    tile_owners,
)
from ringify.runtime.masks.bounds import program_tiles_per_chunk
from ringify.runtime.masks.program import parse
from ringify.runtime.masks.tile_masks import TileMasks
from ringify.runtime.tiling.tiles import Visibility, all_tiles, shard_tiles, sub_ring_tiles
from ringify.testing import RankPool
from ringify.testing.ring_vs_sdpa import document_causal_program, document_inputs

# document ids equal, key at or before query: HF's packed-sequence mask
_DOCUMENT_CAUSAL = document_causal_program()


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


def _tilings(lengths: list[int], ring: int):
    """(program inputs, zigzag tiling, the op's balanced tiling or zigzag's if kept)."""
    seq = sum(lengths)
    inputs = document_inputs(lengths)
    rows = padded_length(seq, ring, "zigzag") // ring
    per_chunk = program_tiles_per_chunk(_DOCUMENT_CAUSAL, inputs, rows, ring, "zigzag")

    def home(rank: int):
        return shard_tiles(rank, ring, rows, "zigzag", True, per_chunk)

    masks = TileMasks(home, ring, None, False, seq, _DOCUMENT_CAUSAL, inputs)
    return inputs, home, balanced_tiling(masks) or home


def op_area(lengths: list[int], ring: int, balanced: bool) -> list[float]:
    """The area of the ring op's kernel calls per rank, from its tile masks."""
    seq = sum(lengths)
    inputs, home, balanced_plan = _tilings(lengths, ring)
    tiling = balanced_plan if balanced else home
    masks = TileMasks(home, ring, None, False, seq, _DOCUMENT_CAUSAL, inputs)
    masks = masks.working_on(tiling)
    work = []
    for rank in range(ring):
        area, mine = 0.0, tiling(rank)
        for j in sorted({t.sub_ring for t in mine}):
            for step in range(ring):
                held = sub_ring_tiles(home((rank - step) % ring), j)
                for b in masks.step_blocks(mine, held, torch.float32, False, False, False).blocks:
                    cells = (b.rows.stop - b.rows.start) * (b.cols.stop - b.cols.start)
                    area += cells / 2 if b.seen is Visibility.DIAGONAL else cells
        work.append(area)
    return work


def modelled(lengths: list[int], ring: int) -> str:
    """The op's modelled ring time over the ideal, zigzag -> balanced."""
    inputs, home, work = _tilings(lengths, ring)
    tiles = all_tiles(home, ring)
    costs = tile_costs(tiles, parse(_DOCUMENT_CAUSAL), inputs, sum(lengths))
    sub_rings = torch.tensor([t.sub_ring for t in tiles])
    ideal = float(costs.sum()) / ring
    keys = tile_owners(home, tiles, ring)
    times = [
        ring_time(costs, tile_owners(tiling, tiles, ring), keys, sub_rings, ring) / ideal
        for tiling in (home, work)
    ]
    return f"{times[0]:.3f} -> {times[1]:.3f}"


def timed(lengths: list[int], balance: bool) -> tuple[float, int]:
    """On every rank: one forward + backward of the ring op; (seconds, bytes sent)."""
    import time

    import torch.distributed as dist

    from ringify.runtime import shard
    from ringify.runtime.collectives.ring import SentBytes

    seq = sum(lengths)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, h, seq, 64, generator=g) for h in (4, 2, 2, 4))
    q, k, v, dout = (
        shard(t, 2, layout="zigzag").contiguous().requires_grad_(t is not dout)
        for t in (q, k, v, dout)
    )
    inputs = document_inputs(lengths)
    name = dist.group.WORLD.group_name
    spec = AttentionSpec(name, 0.125, False, "zigzag", 0.0, _DOCUMENT_CAUSAL, balance=balance)
    args = (None, inputs, seq, spec)
    dist.barrier()
    start = time.perf_counter()
    with SentBytes() as sent:
        out, _ = torch.ops.ringify.ring_attention(q, k, v, *args)
        out.backward(dout)
    dist.barrier()
    return time.perf_counter() - start, sent.bytes


def time_row(pool: RankPool, lengths: list[int], repeats: int) -> dict:
    best = {True: float("inf"), False: float("inf")}
    sent = {}
    for _ in range(repeats):  # interleaved, so that both see the same machine
        for balance in (False, True):
            results = pool.run(timed, lengths, balance, timeout=1800)
            best[balance] = min(best[balance], max(t for t, _ in results))
            sent[balance] = max(b for _, b in results)
    return {
        "zigzag s": round(best[False], 2),
        "balanced s": round(best[True], 2),
        "balanced / zigzag": round(best[True] / best[False], 3),
        "sent MiB zigzag / balanced": f"{sent[False] / 2**20:.0f} / {sent[True] / 2**20:.0f}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--rings", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--time", action="store_true", help="also time the op on gloo ranks")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--mixes", nargs="+", default=[""], help="only the mixes whose names start so"
    )
    args = parser.parse_args()
    rows = []
    for ring in args.rings:
        pool = RankPool(ring) if args.time else None
        for name, lengths in document_mixes(args.seq).items():
            if not any(name.startswith(prefix) for prefix in args.mixes):
                continue
            rows.append({
                "documents": name,
                "P": ring,
                "ideal": _imbalance(ideal(lengths, ring)),
                "op": _imbalance(op_area(lengths, ring, balanced=False)),
                "op balanced": _imbalance(op_area(lengths, ring, balanced=True)),
                "per-doc": _imbalance(per_document(lengths, ring)),
                "modelled / ideal": modelled(lengths, ring),
            })  # fmt: skip
            if pool is not None:
                rows[-1].update(time_row(pool, lengths, args.repeats))
            print(rows[-1], flush=True)
        if pool is not None:
            pool.close()
    print(f"Command: python {' '.join(sys.argv)}")
    print(tabulate(rows, headers="keys", tablefmt="github"))


if __name__ == "__main__":
    main()
