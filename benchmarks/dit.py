"""Per-rank peak memory and step time of a ringified video DiT block vs. the unmodified block.

    python benchmarks/dit.py --frames 16 --side 64
    python benchmarks/dit.py --model cogvideox --frames 16 --side 64

``--model cogvideox``: one block of diffusers' CogVideoX instead (joint attention: the
video tokens and 77 text tokens joined for attention and the feed-forward, then split
back), ``--frames`` latent frames, heads of 64, its unpatchify at the output.

The block is the tests' ``DiTBlock`` (ringify/testing/models.py): a 3-D patch embedding
of a latent video (4 channels, patches of 1 x 2 x 2), adaLN-Zero from the timestep,
self-attention over the patches, cross-attention to a 77-token text embedding, an MLP.
16 frames of 64 x 64 latents are 16 x 32 x 32 = 16384 tokens, born inside the model
(ringify slices them where the patch embedding makes them). float32, batch 1; one step
is forward + backward of the mean square of the output, from the full video on every
rank. Rows in one run, round-robin, minimum over repeats: the unmodified block (one
process), ringify on 2 and on 4 gloo ranks (one torch thread each; time is the slowest
rank's; this machine has 2 cores, so 4 ranks share them).

Memory: a rank's peak resident set during the step minus its resident set just before
(model and inputs built): activations, gradients, buffers.
"""

from __future__ import annotations

import argparse
import os
import sys

from tabulate import tabulate

from ringify.testing import measured_step
from ringify.testing.rounds import best_of_rounds


def _block(name: str, frames: int, side: int, dim: int):
    """(model, inputs as a call's args and kwargs) of ``frames`` latent frames of side x side."""
    import torch

    g = torch.Generator().manual_seed(1)
    text = torch.randn(1, 77, 64, generator=g)
    if name == "cogvideox":
        from diffusers import CogVideoXTransformer3DModel

        model = CogVideoXTransformer3DModel(
            num_attention_heads=dim // 64, attention_head_dim=64, in_channels=4, out_channels=4,
            num_layers=1, sample_width=side, sample_height=side,
            sample_frames=(frames - 1) * 4 + 1, patch_size=2, text_embed_dim=64,
            time_embed_dim=64, max_text_seq_length=77,
        )  # fmt: skip
        video = torch.randn(1, frames, 4, side, side, generator=g)
        kwargs = {"encoder_hidden_states": text, "timestep": torch.tensor([500]),
                  "return_dict": False}  # fmt: skip
        return model, (video,), kwargs
    from ringify.testing.models import DiTBlock

    model = DiTBlock(dim=dim, heads=dim // 64, text_dim=64, max_len=frames * (side // 2) ** 2)
    video = torch.randn(1, 4, frames, side, side, generator=g)
    return model, (video, torch.tensor([500.0]), text), {}


def step(impl: str, name: str, frames: int, side: int, dim: int) -> dict:
    """On every rank: one warm-up step, then one timed and measured."""
    import torch
    import torch.distributed as dist

    from ringify import ringify

    torch.manual_seed(0)
    tokens = frames * (side // 2) ** 2
    model, args, kwargs = _block(name, frames, side, dim)
    run = model if impl == "unmodified" else ringify(model, ring_size=dist.get_world_size())

    def once() -> tuple[float, int, float]:
        model.zero_grad(set_to_none=True)

        def step() -> float:
            out = run(*args, **kwargs)
            loss = (out[0] if isinstance(out, tuple) else out).square().mean()
            loss.backward()
            return loss.item()

        return measured_step(step)

    once()  # warm-up: trace, kernels, allocator, communicators
    seconds, peak, loss = once()
    return {"s": seconds, "peak": peak, "loss": loss, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("dit", "cogvideox"), default="dit")
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--side", type=int, default=64, help="latent height = width")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks

    configs = [("unmodified", 1), ("ringify", 2), ("ringify", 4)]
    shape = (args.model, args.frames, args.side, args.dim)
    best = best_of_rounds(step, [(p, (impl, *shape)) for impl, p in configs], args.repeats)
    base = best[0]
    rows = [
        {
            "tokens": r["tokens"],
            "model": impl if impl == "unmodified" else f"ringify P={p}",
            "step s": round(r["s"], 2),
            "time / unmodified": round(r["s"] / base["s"], 3),
            "peak MiB / rank": round(r["peak"] / 2**20, 1),
            "memory / unmodified": round(r["peak"] / base["peak"], 3),
            "memory / (unmodified / P)": round(r["peak"] * p / base["peak"], 3),
            "|loss - unmodified|": f"{abs(r['loss'] - base['loss']):.1e}",
        }
        for (impl, p), r in zip(configs, best, strict=True)
    ]
    print(f"Command: python {' '.join(sys.argv)}")
    print(tabulate(rows, headers="keys", tablefmt="github"))


if __name__ == "__main__":
    main()
