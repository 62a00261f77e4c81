"""One rank's ring op beside one SDPA call on the whole sequence, on a CUDA GPU.

bf16, Llama-3-8B's heads (32 query heads on 8 kv heads, head dim 128), batch 1, causal
(zigzag). One process is rank 0 of a fake group of ``ring`` ranks, the ring's exchange a
loopback copy (as ``cuda_graphs.py``): the GPU runs one rank's kernels at their real shapes.
The ideal is a rank's op at ``SDPA / P``; the ratios printed are ``op x P / SDPA`` (1.0 is
ideal; the exchange's real NCCL time is not in it), against SDPA as PyTorch picks its kernel
(cuDNN's on Hopper) and against SDPA's FlashAttention-2, the kernel the op's blocks call.
GPU time by CUDA events, best of 5.

    python -m benchmarks.op_vs_sdpa --seqs 32768 131072 --rings 2 4
"""

from __future__ import annotations

import argparse
import contextlib
import time
from unittest import mock

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.cuda_graphs import _loopback
from ringify.testing.ring_vs_sdpa import model_layout

HEADS, KV, DIM = 32, 8, 128
HEADERS = (
    *("S", "P", "SDPA fwd ms", "SDPA bwd ms", "FA2 fwd ms", "FA2 bwd ms", "op fwd ms", "op bwd ms"),
    *("fwd op·P/SDPA", "bwd op·P/SDPA", "fwd op·P/FA2", "bwd op·P/FA2"),
)


DEVICE = "cuda"  # ``--device cpu`` checks the script itself on a small sequence


def _ms(fn, rounds: int = 5) -> float:
    best = float("inf")
    for _ in range(rounds):
        if DEVICE == "cpu":
            start = time.perf_counter()
            fn()
            best = min(best, (time.perf_counter() - start) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def _fwd_bwd(attend, qkv) -> tuple[float, float]:
    out = attend(*qkv)
    grad = torch.randn_like(out)

    def forward():
        attend(*qkv)

    def backward():
        torch.autograd.grad(out, qkv, grad, retain_graph=True)

    forward(), backward()  # warm up
    return _ms(forward), _ms(backward)


def _inputs(seq: int, heads: int = HEADS, kv: int = KV):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    return [
        torch.randn(1, h, seq, DIM, device=DEVICE, dtype=torch.bfloat16, generator=g)
        for h in (heads, kv, kv)
    ]


def sdpa(seq: int, backends: list[SDPBackend] | None = None) -> tuple[float, float]:
    qkv = [t.requires_grad_() for t in _inputs(seq)]
    chosen = sdpa_kernel(backends) if backends else contextlib.nullcontext()
    with chosen:
        return _fwd_bwd(
            lambda q, k, v: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True
            ),
            qkv,
        )


def op(seq: int, ring: int) -> tuple[float, float]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ringify.runtime import ring_attention
    from ringify.runtime.collectives import ring as ring_module

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ring)
    try:
        with mock.patch.object(ring_module, "start_exchange", _loopback):
            qkv = [model_layout(t).requires_grad_() for t in _inputs(seq // ring)]
            return _fwd_bwd(
                lambda q, k, v: ring_attention(
                    q, k, v, is_causal=True, enable_gqa=True, layout="zigzag"
                ),
                qkv,
            )
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--rings", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    print(torch.__version__, torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE)
    rows = []
    for seq in args.seqs:
        whole = sdpa(seq)
        flash = sdpa(seq, [SDPBackend.FLASH_ATTENTION]) if DEVICE == "cuda" else whole
        for ring in args.rings:
            part = op(seq, ring)
            rows.append([seq, ring, *(f"{t:.2f}" for t in (*whole, *flash, *part))])
            for reference in (whole, flash):
                rows[-1] += [f"{p * ring / w:.3f}" for p, w in zip(part, reference, strict=True)]
            print(rows[-1], flush=True)
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    print(tabulate(rows, HEADERS, tablefmt="github"))


if __name__ == "__main__":
    main()
