"""What the ranks' agreement costs, as a ratio to a training step, and how often lengths retrace.

    python benchmarks/agreement.py --seqs 4096 32768
    python benchmarks/agreement.py --retraces 100

Part 1, two gloo ranks, the tests' nanoGPT-style GPT (dim 256, 2 layers, float32,
batch 1, inputs="full"). In one run, per length:

- step: forward + backward of the ringified model, its per-call check included;
- per-call check: ``_prepare`` on a cached signature (signature, state read, the
  fingerprints of the inputs and parameters, one all_gather), with ``check_inputs``
  on, and off (no collective: the signature and state read only);
- per-signature check: ``check_trace`` (digest of the graph, fingerprints, one
  all_gather), which runs once per traced signature, next to the trace itself.

Times are the median of ``--repeats`` calls (the check) or the minimum of them
(the step), both ranks in lockstep; the slowest rank's.

Part 2, one process: 100 steps whose lengths are drawn uniformly from 64-1024, in
eager mode and under ``torch.compile``; the traces ringify made, the graphs Dynamo
compiled, and the same with the lengths padded to multiples of 256.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

from tabulate import tabulate

from ringify.testing import RankPool


def agreement_costs(seq: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    from ringify import ringify
    from ringify.module import _prepare
    from ringify.testing.models import NanoGPT
    from ringify.tracing.consistency import check_trace
    from ringify.tracing.trace import state_of

    torch.manual_seed(0)
    model = NanoGPT(vocab=512, max_len=seq, dim=256, heads=4, layers=2)
    g = torch.Generator().manual_seed(1)
    args = tuple(torch.randint(0, 512, (1, seq), generator=g) for _ in range(2))

    def timed(fn) -> list[float]:
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return times

    def step(run):
        model.zero_grad(set_to_none=True)
        run(*args)[1].backward()

    out = {}
    for check in (True, False):
        run = ringify(model, ring_size=dist.get_world_size(), check_inputs=check)
        step(run)  # trace
        out[f"step {check}"] = min(timed(lambda run=run: step(run)))
        out[f"prepare {check}"] = statistics.median(timed(lambda run=run: _prepare(run, args, {})))
    traced = run._active
    state = state_of(model, traced.state_names)
    out["per signature"] = statistics.median(
        timed(
            lambda: check_trace(
                run._ring,
                graph_code=traced.module.code,
                shared=None,
                state=state,
                error=None,
                args=args,
                kwargs={},
            )
        )
    )
    return out


def costs_table(seqs: list[int], repeats: int) -> str:
    pool = RankPool(2)
    rows = []
    try:
        for seq in seqs:
            per_rank = pool.run(agreement_costs, seq, repeats, timeout=3600)
            worst = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
            step = worst["step True"]
            check = worst["prepare True"]
            rows.append([
                seq,
                f"{step * 1e3:.0f}",
                f"{check * 1e3:.2f}",
                f"{check / step:.4f}",
                f"{worst['prepare False'] * 1e3:.2f}",
                f"{(check - worst['prepare False']) / step:.4f}",
                f"{worst['per signature'] * 1e3:.2f}",
                f"{worst['per signature'] / step:.4f}",
                f"{worst['step True'] / worst['step False']:.2f}",
            ])  # fmt: skip
    finally:
        pool.close()
    return tabulate(
        rows,
        headers=[
            "S",
            "step ms",
            "per-call check ms",
            "/ step",
            "check_inputs=False ms",
            "fingerprint+collective / step",
            "per-signature check ms",
            "/ step",
            "step on/off",
        ],
        tablefmt="github",
    )


class _Count(logging.Handler):
    def __init__(self):
        super().__init__()
        self.traces = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.traces += "traced a new input signature" in record.getMessage()


def retraces(steps: int, bucket: int, compiled: bool) -> tuple[int, int, int]:
    """(distinct lengths, ringify traces, Dynamo graphs) over ``steps`` random lengths."""
    import torch
    import torch._dynamo

    from ringify import ringify
    from ringify.testing.models import NanoGPT

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = NanoGPT(vocab=64, max_len=1024, dim=32, heads=4, layers=2)
    ringified = ringify(model, ring_size=1)
    run = torch.compile(ringified, backend="aot_eager") if compiled else ringified
    counter = _Count()
    logger = logging.getLogger("ringify")
    logger.addHandler(counter)
    logger.setLevel(logging.INFO)
    g = torch.Generator().manual_seed(0)
    lengths = set()
    try:
        for _ in range(steps):
            seq = int(torch.randint(64, 1025, (), generator=g))
            seq = -(-seq // bucket) * bucket
            lengths.add(seq)
            idx = torch.randint(0, 64, (1, seq), generator=g)
            run(idx, idx)[1].backward()
    finally:
        logger.removeHandler(counter)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] if compiled else 0
    return len(lengths), counter.traces, graphs


def retraces_table(steps: int) -> str:
    rows = []
    for bucket in (1, 256):
        for compiled in (False, True):
            lengths, traces, graphs = retraces(steps, bucket, compiled)
            rows.append([
                "exact lengths" if bucket == 1 else f"padded to x{bucket}",
                "torch.compile (aot_eager)" if compiled else "eager",
                steps, lengths, traces, graphs if compiled else "-",
            ])  # fmt: skip
    return tabulate(
        rows,
        headers=["lengths", "mode", "steps", "distinct lengths", "ringify traces", "Dynamo graphs"],
        tablefmt="github",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="*", default=[])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--retraces", type=int, default=0, metavar="STEPS")
    args = parser.parse_args()
    if args.seqs:
        print(costs_table(args.seqs, args.repeats))
    if args.retraces:
        print(retraces_table(args.retraces))


if __name__ == "__main__":
    main()
