"""Host time per layer of the ring op on a CUDA GPU: eager, and replayed from a CUDA graph.

One process is rank 0 of a fake group of ``ring`` ranks (PyTorch's ``FakeProcessGroup``:
every collective returns at once and moves nothing), and the ring's P2P exchange is a
loopback (``_loopback``: each receive buffer gets a sent tensor of its shape copied in, one
kernel where NCCL launches its own), so one GPU runs one rank's kernels at their real
shapes, on finite values, and the host does all of a rank's work. Per case, one
training step's ring op calls are captured with their arguments (``op_replay``: a plan
travels in them as tensors and fields) and run back to back, bf16:
- eager: host µs per layer (the time until the host has launched them: the GPU is slower
  only where "GPU µs" says so) and the GPU's µs per layer, synchronised;
- graph: the same calls captured once in a ``torch.cuda.CUDAGraph`` and replayed (what
  ``torch.compile(mode="reduce-overhead")`` does): host µs per layer to launch the replay,
  GPU µs per layer. Capture fails on any host read or value-sized allocation, so a
  capture that succeeds is the proof; the replay's outputs are compared with eager's.

Cases as ``host_overhead.py`` (HF Llama, 4 layers, hidden 128, 4 heads on 2 kv heads;
``is_causal`` is the op called directly) and ``is_causal`` at Llama-3-8B's heads (32 on 8,
head dim 128). Needs a CUDA GPU and torch 2.13 (RESULTS.md says how it ran on a lent GPU).

    python -m benchmarks.cuda_graphs --seq 8192 --rings 2 4
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

import torch
from tabulate import tabulate

from benchmarks import op_replay
from benchmarks.host_overhead import LAYERS, _model_and_inputs
from ringify.testing.ring_vs_sdpa import model_layout

CASES = ("is_causal", "is_causal 8B", "causal", "padded", "packed", "swa")
HEADERS = (
    *("ring", "case", "calls/layer", "eager host µs/layer", "eager GPU µs/layer"),
    *("graph host µs/layer", "graph GPU µs/layer", "host graph / eager", "graph - eager (rel.)"),
)


def _step(case: str, seq: int, ring: int):
    """One step's function on CUDA in bf16, warmed up (traced, planned)."""
    from ringify import ringify
    from ringify.runtime import ring_attention, shard

    if case.startswith("is_causal"):
        heads, kv, dim = (32, 8, 128) if case.endswith("8B") else (4, 2, 32)
        g = torch.Generator().manual_seed(0)
        full = [torch.randn(1, h, seq, dim, generator=g) for h in (heads, kv, kv)]
        qkv = [
            model_layout(shard(t, 2, layout="zigzag")).cuda().bfloat16().requires_grad_()
            for t in full
        ]

        def step():
            for _ in range(LAYERS):
                ring_attention(
                    *qkv, is_causal=True, enable_gqa=True, layout="zigzag"
                ).sum().backward()

    else:
        model, kwargs = _model_and_inputs(case, seq)
        model = model.cuda().bfloat16()
        kwargs = {name: t.cuda() for name, t in kwargs.items()}
        ringified = ringify(model, ring_size=ring)

        def step():
            model.zero_grad(set_to_none=True)
            ringified(**kwargs).loss.backward()

    step()
    torch.cuda.synchronize()
    return step


def _loopback(ring, sends, receives, *, tag=0):
    """``start_exchange`` on one GPU: each receive buffer gets a sent tensor of its shape."""
    from ringify.runtime.collectives.ring import PendingStep

    sent = [t for _, tensors in sends for t in tensors]
    for _, buffers in receives:
        for buffer in buffers:
            match = next((t for t in sent if t.shape == buffer.shape), None)
            buffer.copy_(match) if match is not None else buffer.zero_()
    return PendingStep([], [buffers for _, buffers in receives], [])


def _run_all(calls):
    outs = []
    for name, captured in calls.items():
        op = getattr(torch.ops.ringify, name.split("::")[1])
        outs.extend(op(*args, **kwargs) for args, kwargs in captured)
    return outs


def _first_tensor(out):
    return out if isinstance(out, torch.Tensor) else next(t for t in out if t is not None)


def _times(fn, loops: int = 20) -> tuple[float, float]:
    """(host µs, synchronised µs) per ``fn()``: the best over 5 rounds of ``loops``."""
    host = total = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(loops):
            fn()
        launched = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        host = min(host, (launched - start) / loops)
        total = min(total, (done - start) / loops)
    return host * 1e6, total * 1e6


def measure(case: str, seq: int, ring: int) -> list:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ringify.runtime.collectives import ring as ring_module
    from ringify.runtime.masks import captures

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ring)
    try:
        # each case records its own graphs: the record of recorded plans is the case's own
        # (padded and packed share a site; in one process, one's recording refuses the other)
        with (
            mock.patch.object(ring_module, "start_exchange", _loopback),
            mock.patch.dict(captures._captured, clear=True),
        ):
            calls = op_replay.captured_calls(_step(case, seq, ring))
            times, diff = _eager_and_graph(calls)
    finally:
        dist.destroy_process_group()
    n = sum(len(c) for c in calls.values())
    return [
        ring, case, n // LAYERS, *(f"{t / LAYERS:.0f}" for t in times),
        f"{times[2] / times[0]:.3f}", f"{diff:.1e}",
    ]  # fmt: skip


@torch.no_grad()
def _eager_and_graph(calls) -> tuple[list[float], float]:
    """Eager and graph-replayed (host µs, GPU µs) of ``calls``, and the largest difference
    between their outputs relative to the largest eager output."""
    eager_host, eager_total = _times(lambda: _run_all(calls))
    eager = [_first_tensor(o).float() for o in _run_all(calls)]
    side = torch.cuda.Stream()  # warm up off the capturing stream, as PyTorch's docs do
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            _run_all(calls)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _run_all(calls)
    graph_host, graph_total = _times(graph.replay)
    graph.replay()
    diff = max(
        ((_first_tensor(o).float() - e).abs().max() / e.abs().max()).item()
        for o, e in zip(outs, eager, strict=True)
    )
    return [eager_host, eager_total, graph_host, graph_total], diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--rings", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--cases", nargs="+", default=list(CASES))
    args = parser.parse_args()
    print(torch.__version__, torch.cuda.get_device_name())
    rows = []
    for ring in args.rings:
        for case in args.cases:
            try:
                rows.append(measure(case, args.seq, ring))
            except Exception as error:  # a failed capture is a finding: report it, go on
                rows.append([ring, case, f"failed: {type(error).__name__}: {error}"[:300]])
            print(rows[-1], flush=True)
    print(tabulate(rows, HEADERS, tablefmt="github"))


if __name__ == "__main__":
    main()
