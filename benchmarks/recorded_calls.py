"""What a ring call recorded into a CUDA graph launches, against the same call run eagerly.

``torch.compile(mode="reduce-overhead")`` records a step's ring calls once and replays their
kernels: a replay's GPU time is the recorded calls' kernels. This CPU has no CUDA graph, so
the ops are told they are being recorded (``ops.capturing``), with a GPU's tiles, FA2 varlen
calls and the attention kernels stubbed (``kernel_stubs``: they count the FLOPs they would
run). One training step's ring calls (HF Llama, 4 layers, hidden 128, 4 heads on 2 kv
heads, as ``host_overhead.py``) are captured with their arguments and replayed on rank 0,
eagerly and "recorded"; per layer, forward + backward: the kernels launched (leaf ATen ops
that launch or allocate, as ``host_overhead._host_cost`` counts them), the attention FLOPs,
and a paper model of the GPU's time (labelled so: FLOPs scaled to Llama-3-8B's heads at 400
TFLOP/s, plus ``KERNEL_GPU_US`` per kernel, a small kernel's least time on an H100).

    python -m benchmarks.recorded_calls --seq 8192
"""

from __future__ import annotations

import argparse
from unittest import mock

import torch
from tabulate import tabulate

from benchmarks import kernel_stubs, op_replay
from benchmarks.host_overhead import (
    BENCH_HEAD_DIM,
    BENCH_HEADS,
    BF16_FLOPS,
    LAYERS,
    D,
    H,
    _host_cost,
    _step,
)
from ringify.testing import RankPool

CASES = ("causal", "padded", "packed", "swa")
KERNEL_GPU_US = 3.0  # a small kernel's least GPU time (launch to completion) on an H100


def recorded_and_eager(case: str, seq: int) -> dict[str, tuple[float, float]]:
    """On rank 0: ``{"eager" | "recorded": (kernels, FLOPs)}`` per layer, forward + backward."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from ringify.runtime.attention import ops
    from ringify.runtime.masks import captures

    sent = [0, 0.0]
    got: dict[str, tuple[float, float]] = {}
    with kernel_stubs.ringify_stubs(sent):
        step = _step(case, seq, True)
        step()
        calls = op_replay.captured_calls(step)
        if dist.get_rank() != 0:
            return got
        for how, recording in (("eager", False), ("recorded", True)):
            sent[1] = 0.0
            with (  # each case records its own (padded and packed share a site)
                mock.patch.dict(captures._captured, clear=True),
                mock.patch.object(ops, "capturing", lambda device, r=recording: r),
                torch.no_grad(),
                profile(activities=[ProfilerActivity.CPU]) as prof,
            ):
                for name, captured in calls.items():
                    op = getattr(torch.ops.ringify, name.split("::")[1])
                    for args, kwargs in captured:
                        op(*args, **kwargs)
            kernels = sum(_host_cost(e)[1] for e in prof.events() if e.name in op_replay.OPS)
            got[how] = (kernels / LAYERS, sent[1] / LAYERS)
    return got


def gpu_us(kernels: float, flops: float) -> float:
    """The paper model's GPU µs per layer: FLOPs at Llama-3-8B's heads, plus kernels."""
    scaled = flops * (H * D) / (BENCH_HEADS * BENCH_HEAD_DIM)
    return scaled / BF16_FLOPS * 1e6 + KERNEL_GPU_US * kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--ring", type=int, default=2)
    args = parser.parse_args()
    rows = []
    pool = RankPool(args.ring)
    try:
        for case in CASES:
            got = pool.run(recorded_and_eager, case, args.seq, timeout=3600)[0]
            (ek, ef), (rk, rf) = got["eager"], got["recorded"]
            eager, recorded = gpu_us(ek, ef), gpu_us(rk, rf)
            rows.append([
                args.ring, case, f"{ek:.0f}", f"{rk:.0f}", f"{rf / ef:.2f}",
                f"{eager:.0f}", f"{recorded:.0f}", f"{recorded / eager:.2f}",
            ])  # fmt: skip
            print(tabulate([rows[-1]]), flush=True)
    finally:
        pool.close()
    headers = [
        "ring", "case", "eager kernels/layer", "recorded kernels/layer", "recorded / eager FLOPs",
        "paper GPU µs/layer eager", "paper GPU µs/layer recorded", "recorded / eager",
    ]  # fmt: skip
    print(tabulate(rows, headers=headers, tablefmt="github"))


if __name__ == "__main__":
    main()
