"""An unmodified HF GPT-2 made sequence-parallel by ringify, checked against itself.

    torchrun --nproc-per-node 2 examples/gpt2.py [--seq 2048 --compile]

Every rank builds the same GPT-2 (random weights from a small config, nothing is
downloaded) and the same token ids, runs one training step (forward with labels,
backward) through ``ringify(model, ring_size=world)``, prints the pass's report,
the largest difference from the unmodified model (logits, loss, every gradient)
and each rank's peak memory for the step, against the unmodified model's.
CUDA ranks use NCCL, CPU ranks gloo.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

from ringify import ringify
from ringify.testing import reset_peak_memory, resident_bytes


def build(args) -> GPT2LMHeadModel:
    config = GPT2Config(
        n_layer=args.layers,
        n_embd=args.dim,
        n_head=args.dim // 64,
        n_positions=args.seq,
        vocab_size=4096,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        use_cache=False,  # a KV cache object is not a tensor output torch.export can trace
        bos_token_id=0,
        eos_token_id=0,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def train_step(run, model, ids, device):
    """Forward with labels and backward; returns (logits, loss, grads, peak bytes of the step)."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        base = resident_bytes("VmRSS:")
        reset_peak_memory()
    out = run(input_ids=ids, labels=ids)
    out.loss.backward()
    peak = (
        torch.cuda.max_memory_allocated(device)
        if device.type == "cuda"
        else resident_bytes("VmHWM:")
    ) - base
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.logits.detach(), out.loss.detach(), grads, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--compile", action="store_true", help="torch.compile the ringified model")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    model = build(args).to(device)
    ids = torch.randint(0, 4096, (1, args.seq), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)

    ringified = ringify(model, ring_size=world)
    run = torch.compile(ringified, fullgraph=True) if args.compile else ringified
    train_step(run, model, ids, device)  # warm-up: trace (and compile)
    logits, loss, grads, peak = train_step(run, model, ids, device)
    want_logits, want_loss, want_grads, want_peak = train_step(model, model, ids, device)

    diff = max(
        (logits - want_logits).abs().max().item(),
        (loss - want_loss).abs().item(),
        max((grads[n] - want_grads[n]).abs().max().item() for n in grads),
    )
    if rank == 0:
        print(ringified.report())
    for r in range(world):
        if r == rank:
            print(
                f"rank {rank}/{world} ({dist.get_backend()}): seq {args.seq}, loss {loss.item():.6f}, "
                f"max |ringified - unmodified| over logits, loss and grads = {diff:.2e}; "
                f"peak memory of the step {peak / 2**20:.0f} MiB "
                f"(unmodified model: {want_peak / 2**20:.0f} MiB)",
                flush=True,
            )
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
