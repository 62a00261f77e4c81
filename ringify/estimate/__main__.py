"""``python -m ringify.estimate --config config.json --seq 262144 --gpus 64 --gpu h100-80gb``:
every mesh's memory per GPU and modelled step, the best first."""

from __future__ import annotations

import argparse
import sys

from ringify.estimate import estimate
from ringify.runtime.collectives.transport_costs import GPUS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringify.estimate", description=__doc__)
    parser.add_argument(
        "--config", required=True, help="a config.json, a folder holding one, or a cached model id"
    )
    parser.add_argument("--seq", type=int, required=True, help="positions per sequence")
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--gpu", default="h100-80gb", help=f"one of {', '.join(GPUS)}")
    parser.add_argument("--batch", type=int, default=1, help="sequences per replica")
    parser.add_argument("--headroom", type=float, default=0.1, help="memory left free")
    parser.add_argument(
        "--outputs",
        default="sharded",
        choices=["sharded", "full"],
        help="ringify's outputs: whole on every rank, or each rank's part",
    )
    parser.add_argument("--top", type=int, default=10, help="rows shown")
    parser.add_argument("--why", type=int, metavar="ROW", help="explain one row")
    args = parser.parse_args(argv)
    try:
        result = estimate(
            args.config, args.seq, args.gpus, gpu=args.gpu, batch=args.batch, headroom=args.headroom
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result.table(args.top))
    if args.why is not None:
        print()
        print(result.why(args.why))
    return 0


if __name__ == "__main__":
    sys.exit(main())
