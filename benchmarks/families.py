"""What the family benchmarks share (``dit_families``, ``moe_families``): the columns of a
model's row that compare it with the unmodified model, and the run over families on a ring."""

from __future__ import annotations

import argparse

from tabulate import tabulate

from ringify.testing import RankPool


def compared(want: dict, got: dict, own: dict, report) -> dict:
    """The largest gradient differences from the unmodified model (``got``) and within it
    (``own``: reordered), whether every parameter got a gradient, and the gathers left."""
    return {
        "gradients": max((got[n] - want[n]).abs().max().item() for n in want),
        "own reordering": max((own[n] - want[n]).abs().max().item() for n in want),
        "every gradient": set(got) == set(want),
        "gathers": len(report.gathers),
        "reasons": "; ".join(sorted({f"{g.op}: {g.reason.value}" for g in report.gathers})),
    }


def main(doc: str, families: tuple[str, ...], compare) -> None:
    """``compare(family, ranks)`` for each family on one ring of ranks; their rows as a table."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--families", nargs="*", default=list(families))
    args = parser.parse_args()
    pool = RankPool(args.ranks)
    rows = []
    try:
        for family in args.families:
            try:
                rows.append(pool.run(compare, family, args.ranks, timeout=900)[0])
            except ValueError as e:  # ringify's clear error, on every rank: the family's row
                rows.append({"family": family, "error": str(e).splitlines()[0][:160]})
    finally:
        pool.close()
    print(tabulate(rows, headers="keys", floatfmt=".1e"))
