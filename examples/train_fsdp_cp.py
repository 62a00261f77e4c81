"""Train an HF Llama with FSDP2 per layer, activation checkpointing and ringify on a
(dp, cp) mesh, or with tensor parallelism too on a (dp, tp, cp) mesh, and check it against
one process training on the global batch.

    torchrun --nproc-per-node 4 examples/train_fsdp_cp.py [--dp 2 --steps 3 --seq 64]
    torchrun --nproc-per-node 8 examples/train_fsdp_cp.py --dp 2 --tp 2

The torchtitan recipe on an unmodified model: with ``--tp``, split the heads and MLP columns
over tp with the model's own ``base_model_tp_plan`` (transformers' TP); checkpoint every
decoder layer, shard every layer and the root with FSDP2 over dp x cp (so each weight's
gradient is reduced once, by FSDP), ring the sequence over cp. Each dp replica trains on
its own batch; the ranks of one ring (and of one TP group) share it. Rank 0 then trains the
same model alone on the global batch (float64, same AdamW) and prints the largest
difference of any weight. CUDA ranks use NCCL, CPU ranks gloo.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import DistributedConfig, LlamaConfig, LlamaForCausalLM
from transformers.distributed.tensor_parallel import apply_tensor_parallelism

from ringify import ringify


def build(args) -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=args.dim,
        intermediate_size=2 * args.dim,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=args.seq,
        use_cache=False,  # a KV cache object is not a tensor output torch.export can trace
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).double()


def batches(args) -> torch.Tensor:
    """(steps, dp * batch, seq) token ids: each step's global batch."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(1, 256, (args.steps, args.dp * args.batch, args.seq), generator=g)


def train(model, run, ids_per_step, lr: float) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for ids in ids_per_step:
        run(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2, help="sequences per dp replica")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args()

    device = torch.device(
        f"cuda:{os.environ['LOCAL_RANK']}" if torch.cuda.is_available() else "cpu"
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    cp = dist.get_world_size() // (args.dp * args.tp)
    shape, names = (args.dp, args.tp, cp), ("dp", "tp", "cp")
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)

    model = build(args).to(device)
    if args.tp > 1:  # the model's own TP plan, applied by transformers
        if hasattr(model, "_resolve_parallel_plans"):  # transformers 5.2x: the plan per layer
            plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=args.tp))
            apply_tensor_parallelism(model, mesh["tp"], plan)
        else:  # transformers 5.16: model.tp_plan, as it is
            apply_tensor_parallelism(model, mesh["tp"])
    # transformers 5.24 renamed it (the old name warns)
    enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
    enable({"use_reentrant": False})
    shard_over = mesh["dp", "cp"]._flatten()  # FSDP over dp x cp: gradients reduced once
    for layer in model.model.layers:
        fully_shard(layer, mesh=shard_over)
    ringified = fully_shard(ringify(model, ring_size=cp, mesh=mesh["cp"]), mesh=shard_over)

    replica = batches(args).split(args.batch, dim=1)[mesh["dp"].get_local_rank()]
    train(model, ringified, replica.to(device), lr=1e-2)
    weights = {n: p.full_tensor().cpu() for n, p in model.named_parameters()}
    if dist.get_rank() == 0:
        print(ringified.report())
        alone = build(args)
        train(alone, alone, batches(args), lr=1e-2)
        err = max((weights[n] - p.detach()).abs().max().item() for n, p in alone.named_parameters())
        print(
            f"dp={args.dp} x tp={args.tp} x cp={cp}, FSDP2 per layer over dp x cp, "
            f"{len(ringified.report().checkpointed)} "
            f"layers checkpointed, {args.steps} AdamW steps: largest weight difference from "
            f"one process on the global batch {err:.2e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
