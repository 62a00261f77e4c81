"""``ringify.estimate``'s memory beside a measured step: the models it is checked on, and one
rank's measurement against the estimate, for ``tests/test_estimate.py`` and
``benchmarks/estimate.py``.

Measured: the rank's resident bytes the model's parameters add, plus the peak a training step
(forward and backward, gradients set to none before) adds above them, large allocations
returned to the system at once (``mallopt``), after a warm-up step. Estimated: the weights, the
gradients, the traced graph's activations at the rank's positions, the other ranks' parts of
the outputs (``outputs="full"``, ringify's default) and the transport's buffers (no FSDP, no
optimizer, float32: as run here)."""

from __future__ import annotations

import ctypes
import math

import torch

from ringify.testing.process_memory import measured_step, resident_bytes

CASES = {
    # name: (ring size, tp, checkpointed, per-rank positions at two lengths)
    "llama": (2, 1, False, (2048, 4096)),
    "llama, checkpointed": (4, 1, True, (2048, 4096)),
    "llama, tp 2": (2, 2, False, (2048, 4096)),
    "qwen3_moe": (2, 1, False, (1024, 2048)),
    "bamba": (2, 1, False, (2048, 4096)),
    "sd3": (2, 1, False, (1152, 2048)),
}
_M_MMAP_THRESHOLD = -3
# Llama-3-8B's config (the time and cost checks of tests/test_estimate.py and
# benchmarks/estimate.py)
LLAMA_8B = dict(
    model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
    max_position_embeddings=131072, rms_norm_eps=1e-5,
)  # fmt: skip


def model_of(case: str):
    """``(model, inputs(positions, device))``: float32, batch 1, one sequence."""
    import transformers as tf

    torch.manual_seed(0)
    lm = dict(vocab_size=2048, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, intermediate_size=688, use_cache=False,
              max_position_embeddings=1 << 16, pad_token_id=0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    if case.startswith("llama"):
        config = tf.LlamaConfig(**lm)
        model_class = tf.LlamaForCausalLM
    elif case == "qwen3_moe":
        config = tf.Qwen3MoeConfig(**lm, head_dim=32, moe_intermediate_size=32, num_experts=4,
                                   num_experts_per_tok=2, norm_topk_prob=True)  # fmt: skip
        config._experts_implementation = "batched_mm"  # (grouped_mm's fake kernel: bf16 only)
        model_class = tf.Qwen3MoeForCausalLM
    elif case == "bamba":
        config = tf.BambaConfig(**lm, attn_layer_indices=[1, 3], mamba_n_heads=8,
                                mamba_d_head=64, mamba_n_groups=1, mamba_d_state=16,
                                mamba_chunk_size=64, mamba_expand=2, mamba_d_conv=4)  # fmt: skip
        model_class = tf.BambaForCausalLM
    elif case == "sd3":
        return _sd3()
    else:
        raise ValueError(f"unknown case {case!r}")
    config._attn_implementation = "sdpa"
    model = model_class(config)

    def inputs(positions: int, device="cpu") -> dict:
        ids = torch.arange(positions, device=device).remainder(2047).add(1)[None]
        return {"input_ids": ids, "labels": ids}

    return model, inputs


def _sd3():
    from diffusers import SD3Transformer2DModel

    model = SD3Transformer2DModel(
        sample_size=128, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=32,
        num_attention_heads=8, joint_attention_dim=64, caption_projection_dim=256,
        pooled_projection_dim=32, out_channels=4, pos_embed_max_size=256,
    )  # fmt: skip

    def inputs(positions: int, device="cpu") -> dict:
        side = 2 * math.isqrt(positions)  # positions image tokens of 2 x 2 patches
        g = torch.Generator().manual_seed(3)
        return {
            "hidden_states": torch.randn(1, 4, side, side, generator=g).to(device),
            "encoder_hidden_states": torch.randn(1, 8, 64, generator=g).to(device),
            "pooled_projections": torch.randn(1, 32, generator=g).to(device),
            "timestep": torch.tensor([500.0], device=device),
            "return_dict": False,
        }

    return model, inputs


def measured_and_estimated(case: str, length: int) -> dict:
    """On each rank: the measured and the estimated bytes of ``case`` at its ``length``-th
    per-rank positions (0 or 1)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ringify import ringify
    from ringify.estimate.footprint import footprint, loss_of
    from ringify.estimate.meshes import Mesh, row
    from ringify.runtime.collectives.heads import Transport
    from ringify.runtime.collectives.transport_costs import H100

    ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 65536)
    ring, tp, checkpointed, lengths = CASES[case]
    positions = lengths[length]
    seq = positions * ring
    model, inputs = model_of(case)
    # the estimate: from the unmodified model (a meta copy), before anything runs
    fp = footprint(model, lambda n: inputs(n, "meta"), tp=tp, dtype=None, probes=(256, 576, 1024))
    estimated = row(fp, Mesh(1, tp, ring, Transport(ring)), seq, 1, H100, checkpointed,
                    fsdp=False, optimizer=False, outputs="full")  # fmt: skip
    del model
    gc_base = _settled()
    model, _ = model_of(case)
    if checkpointed:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    mesh = None
    if tp > 1:
        from transformers import DistributedConfig
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        mesh = init_device_mesh("cpu", (ring, tp), mesh_dim_names=("cp", "tp"))
        plan = model._resolve_parallel_plans(DistributedConfig(tp_size=tp))[0]
        model = apply_tensor_parallelism(model, mesh["tp"], plan)
    weights = _settled() - gc_base
    run = ringify(model, ring_size=ring, mesh=mesh["cp"] if mesh is not None else None)
    given = inputs(seq)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        loss_of(run(**given)).backward()

    step()  # the trace, the communicators
    model.zero_grad(set_to_none=True)
    _, peak, _ = measured_step(step)
    dist.barrier()
    return {
        "measured": weights + peak,
        "estimated": estimated.total,
        "weights": estimated.weights,
        "activations": estimated.activations,
        "buffers": estimated.buffers,
        "gathers": len(run.report().gathers),
    }


def _settled() -> int:
    import gc

    gc.collect()
    return resident_bytes()
