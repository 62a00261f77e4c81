"""Tiny diffusers transformers with joint attention (text and image tokens attended together),
built from configs (random weights), and their inputs in float64.

SD3 (MM-DiT: joint attention, then the text and image tokens split back), Flux (double
blocks like SD3's, single blocks that run a whole block on the joint sequence; RoPE from
the text and image ids put end to end) and CogVideoX (the text and video tokens joined for
attention and the feed-forward; RoPE on the video tokens only, written into a slice).
QwenImage and HunyuanVideo join them too, under a padding mask of the text tokens (the
second row's last two text tokens hidden), and CogView4; Wan, LTX-Video, AuraFlow,
Allegro and Chroma for ``benchmarks/dit_families.py``. DiT and PixArt (self-attention over the image tokens; PixArt cross-attends to the text)
have no joint sequence; with the others they end in an unpatchify, a view of the tokens
into the image's grid. Each returns ``(model, kwargs)``; the model's output is
``model(**kwargs)[0]``.
"""

from __future__ import annotations

import torch


def _randn(*shape, seed: int = 3) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def sd3(side: int = 8) -> tuple[torch.nn.Module, dict]:
    """SD3: (side / 2)^2 image tokens beside 5 text tokens."""
    from diffusers import SD3Transformer2DModel

    model = SD3Transformer2DModel(
        sample_size=side, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=16, caption_projection_dim=32,
        pooled_projection_dim=8, out_channels=4, pos_embed_max_size=2 * side,
    )  # fmt: skip
    kwargs = {
        "hidden_states": _randn(2, 4, side, side),
        "encoder_hidden_states": _randn(2, 5, 16, seed=4),
        "pooled_projections": _randn(2, 8, seed=5),
        "timestep": torch.tensor([3.0, 500.0], dtype=torch.float64),
        "return_dict": False,
    }
    return model.double(), kwargs


def flux(height: int = 4, width: int = 8) -> tuple[torch.nn.Module, dict]:
    """Flux: height x width image tokens beside 5 text tokens, one double and one single block."""
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8,
        axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    kwargs = _flux_inputs(height, width) | {"pooled_projections": _randn(2, 8, seed=5)}
    return model.double(), kwargs


def _flux_inputs(height: int, width: int) -> dict:
    """Flux's and Chroma's inputs: height x width image tokens (8 channels) with their ids
    on the grid, 5 text tokens with ids 0."""
    grid = torch.meshgrid(
        torch.zeros(1), torch.arange(float(height)), torch.arange(float(width)), indexing="ij"
    )
    return {
        "hidden_states": _randn(2, height * width, 8),
        "encoder_hidden_states": _randn(2, 5, 16, seed=4),
        "timestep": torch.tensor([0.3, 0.5], dtype=torch.float64),
        "img_ids": torch.stack(grid, -1).reshape(-1, 3).double(),
        "txt_ids": torch.zeros(5, 3, dtype=torch.float64),
        "return_dict": False,
    }


def cogvideox(
    frames: int = 9, side: int = 8, height: int | None = None, layers: int = 2
) -> tuple[torch.nn.Module, dict]:
    """CogVideoX: ((frames - 1) / 4 + 1) latent frames of (height / 2) x (side / 2) patches
    (square unless ``height``) beside 5 text tokens."""
    from diffusers import CogVideoXTransformer3DModel

    latent, height = (frames - 1) // 4 + 1, height or side
    model = CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        num_layers=layers, sample_width=side, sample_height=height, sample_frames=frames,
        patch_size=2, text_embed_dim=16, time_embed_dim=8, max_text_seq_length=5,
    )  # fmt: skip
    kwargs = {
        "hidden_states": _randn(2, latent, 4, height, side),
        "encoder_hidden_states": _randn(2, 5, 16, seed=4),
        "timestep": torch.tensor([3, 500]),
        "return_dict": False,
    }
    return model.double(), kwargs


def dit(side: int = 8) -> tuple[torch.nn.Module, dict]:
    """DiT: (side / 2)^2 image tokens, class-conditioned."""
    from diffusers import DiTTransformer2DModel

    model = DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=2,
        sample_size=side, patch_size=2, num_embeds_ada_norm=10, norm_num_groups=4,
    )  # fmt: skip
    kwargs = {
        "hidden_states": _randn(2, 4, side, side),
        "timestep": torch.tensor([3, 5]),
        "class_labels": torch.tensor([1, 2]),
        "return_dict": False,
    }
    return model.double(), kwargs


def pixart(side: int = 8) -> tuple[torch.nn.Module, dict]:
    """PixArt: (side / 2)^2 image tokens cross-attending to 5 text tokens."""
    from diffusers import PixArtTransformer2DModel

    model = PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
        num_layers=2, sample_size=side, patch_size=2, cross_attention_dim=16,
        caption_channels=12, norm_num_groups=4, use_additional_conditions=False,
    )  # fmt: skip
    kwargs = {
        "hidden_states": _randn(2, 4, side, side),
        "timestep": torch.tensor([3, 5]),
        "encoder_hidden_states": _randn(2, 5, 12, seed=4),
        "return_dict": False,
    }
    return model.double(), kwargs


def _text_mask(dtype=torch.bool) -> torch.Tensor:
    mask = torch.ones(2, 5, dtype=dtype)
    mask[1, 3:] = 0  # the second row's last two text tokens are padding
    return mask


def qwenimage(side: int = 8) -> tuple[torch.nn.Module, dict]:
    """QwenImage: (side / 2)^2 image tokens (packed 2 x 2 latents) beside 5 text tokens under
    a padding mask."""
    from diffusers import QwenImageTransformer2DModel

    model = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    patches = (side // 2) ** 2
    kwargs = {
        "hidden_states": _randn(2, patches, 16),
        "encoder_hidden_states": _randn(2, 5, 16, seed=4),
        "encoder_hidden_states_mask": _text_mask(),
        "timestep": torch.tensor([0.3, 0.5], dtype=torch.float64),
        "img_shapes": [[(1, side // 2, side // 2)]] * 2,
        "return_dict": False,
    }
    return model.double(), kwargs


def hunyuan_video(frames: int = 4, side: int = 8) -> tuple[torch.nn.Module, dict]:
    """HunyuanVideo: frames of (side / 2)^2 patches beside 5 text tokens under a padding mask
    (a double and a single block, a token refiner)."""
    from diffusers import HunyuanVideoTransformer3DModel

    model = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12,
        num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=2,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(4, 4, 4),
    )  # fmt: skip
    kwargs = {
        "hidden_states": _randn(2, 4, frames, side, side),
        "timestep": torch.tensor([3, 500]),
        "encoder_hidden_states": _randn(2, 5, 16, seed=4),
        "encoder_attention_mask": _text_mask(torch.int64),
        "pooled_projections": _randn(2, 8, seed=5),
        "guidance": torch.tensor([3000.0, 3000.0]),
        "return_dict": False,
    }
    return model.double(), kwargs


def cogview4(side: int = 8) -> tuple[torch.nn.Module, dict]:
    """CogView4: (side / 2)^2 image tokens beside 5 text tokens (its output cast with
    ``type_as`` of the joint queries)."""
    from diffusers import CogView4Transformer2DModel

    model = CogView4Transformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, text_embed_dim=16, time_embed_dim=8, condition_dim=4,
        pos_embed_max_size=16, sample_size=side, rope_axes_dim=(4, 4),
    )  # fmt: skip
    size = torch.tensor([[float(side), float(side)]] * 2, dtype=torch.float64)
    kwargs = {
        "hidden_states": _randn(2, 4, side, side),
        "encoder_hidden_states": _randn(2, 5, 16, seed=4),
        "timestep": torch.tensor([3, 500]),
        "original_size": size,
        "target_size": size,
        "crop_coords": torch.zeros(2, 2, dtype=torch.float64),
        "return_dict": False,
    }
    return model.double(), kwargs


def wan(frames: int = 4, side: int = 8) -> tuple[torch.nn.Module, dict]:
    """Wan: frames of (side / 2)^2 patches cross-attending to 5 text tokens (its norms and
    modulation run in float32 inside a float64 model)."""
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32,
    )  # fmt: skip
    kwargs = {
        "hidden_states": _randn(2, 4, frames, side, side),
        "timestep": torch.tensor([3, 500]),
        "encoder_hidden_states": _randn(2, 5, 16, seed=4),
        "return_dict": False,
    }
    return model.double(), kwargs


def ltx_video(frames: int = 4, side: int = 4) -> tuple[torch.nn.Module, dict]:
    """LTX-Video: frames x side x side tokens (patch 1) cross-attending to 5 text tokens."""
    from diffusers import LTXVideoTransformer3DModel

    model = LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, num_layers=2, caption_channels=12,
    )  # fmt: skip
    kwargs = {
        "hidden_states": _randn(2, frames * side * side, 8),
        "encoder_hidden_states": _randn(2, 5, 12, seed=4),
        "timestep": torch.tensor([3, 500]),
        "encoder_attention_mask": torch.ones(2, 5),
        "num_frames": frames,
        "height": side,
        "width": side,
        "return_dict": False,
    }
    return model.double(), kwargs


def auraflow(side: int = 8) -> tuple[torch.nn.Module, dict]:
    """AuraFlow: (side / 2)^2 image tokens beside 5 text tokens (an MM-DiT and a DiT block)."""
    from diffusers import AuraFlowTransformer2DModel

    model = AuraFlowTransformer2DModel(
        sample_size=side, patch_size=2, in_channels=4, num_mmdit_layers=1,
        num_single_dit_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, out_channels=4, pos_embed_max_size=64,
    )  # fmt: skip
    kwargs = {
        "hidden_states": _randn(2, 4, side, side),
        "encoder_hidden_states": _randn(2, 5, 16, seed=4),
        "timestep": torch.tensor([3.0, 500.0], dtype=torch.float64),
        "return_dict": False,
    }
    return model.double(), kwargs


def allegro(frames: int = 4, side: int = 8) -> tuple[torch.nn.Module, dict]:
    """Allegro: frames of (side / 2)^2 patches cross-attending to 5 text tokens."""
    from diffusers import AllegroTransformer3DModel

    model = AllegroTransformer3DModel(
        patch_size=2, patch_size_t=1, num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, num_layers=2, cross_attention_dim=16, sample_height=side,
        sample_width=side, sample_frames=frames, caption_channels=12,
    )  # fmt: skip
    kwargs = {
        "hidden_states": _randn(2, 4, frames, side, side),
        "encoder_hidden_states": _randn(2, 5, 12, seed=4),
        "timestep": torch.tensor([3, 500]),
        "return_dict": False,
    }
    return model.double(), kwargs


def chroma(height: int = 4, width: int = 8, masked: int = 0) -> tuple[torch.nn.Module, dict]:
    """Chroma: Flux's blocks under a token mask made a (queries x keys) matrix; ``masked``:
    the second sample's last image tokens masked too (rows and columns)."""
    from diffusers import ChromaTransformer2DModel

    model = ChromaTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(4, 6, 6),
        approximator_num_channels=8, approximator_hidden_dim=16, approximator_layers=1,
    )  # fmt: skip
    mask = torch.cat([_text_mask(), torch.ones(2, height * width, dtype=torch.bool)], 1)
    mask[1, mask.shape[1] - masked :] = False
    return model.double(), _flux_inputs(height, width) | {"attention_mask": mask}
