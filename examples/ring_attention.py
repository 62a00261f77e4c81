"""Ring attention on P ranks vs. F.scaled_dot_product_attention on the full sequence.

    torchrun --nproc-per-node 2 examples/ring_attention.py [--seq 4096 --causal]

CUDA ranks use NCCL, CPU ranks gloo; every rank builds the same full inputs,
keeps its zigzag shard, and runs ring_attention forward and backward.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ringify.runtime import gather, ring_attention, shard


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()

    device = torch.device(
        f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu"
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, h, args.seq, args.dim, generator=g).to(device)
        for h in (args.heads, args.kv_heads, args.kv_heads)
    )
    local = [shard(t, 2, layout="zigzag").clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, is_causal=args.causal, enable_gqa=True, layout="zigzag")
    out.square().sum().backward()

    full = gather(out.detach(), 2, layout="zigzag")
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=args.causal, enable_gqa=True)
    diff = (full - ref).abs().max().item()
    if rank == 0:
        print(
            f"{world} ranks ({dist.get_backend()}), seq {args.seq}, causal={args.causal}: "
            f"local q {tuple(local[0].shape)}, max |ring - sdpa| = {diff:.2e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
