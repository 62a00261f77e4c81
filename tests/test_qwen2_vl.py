"""Qwen2-VL: the vision tower outside ringify, the language model on the ring.

``torch.export`` cannot trace Qwen2-VL's vision tower (its attention splits by
``lengths.tolist()``), and neither can ringify: the error names that line. The recipe
(README): run the vision tower and M-RoPE's 3-D positions on every rank as the model does,
and give the ringified model ``inputs_embeds`` and ``position_ids``. Against the unmodified
model on 2 and 4 ranks, float64: logits and every parameter gradient, the vision tower's
included (through ``inputs_embeds``).
"""

from __future__ import annotations

import pytest
import torch

from ringify.testing.runs import ringified_run

TOL = 1e-10
IMAGE = 200


def _model():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    text = {
        "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "bos_token_id": 0,
        "eos_token_id": 0, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
    }  # fmt: skip
    vision = {
        "depth": 1, "embed_dim": 32, "hidden_size": 32, "num_heads": 4, "in_chans": 3,
        "patch_size": 2, "spatial_merge_size": 1, "temporal_patch_size": 1,
    }  # fmt: skip
    config = Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=IMAGE, vision_start_token_id=202
    )
    return Qwen2VLForConditionalGeneration(config).double()


def embedded(model, ids, pixels, grid, mm_types):
    """What Qwen2-VL computes before its language model: the recipe's part outside ringify."""
    inner = model.model
    embeds = inner.get_input_embeddings()(ids)
    image = torch.cat(inner.get_image_features(pixels, grid, return_dict=True).pooler_output)
    mask, _ = inner.get_placeholder_mask(ids, inputs_embeds=embeds, image_features=image)
    embeds = embeds.masked_scatter(mask, image.to(embeds.dtype))
    positions = inner.compute_3d_position_ids(
        input_ids=ids, image_grid_thw=grid, inputs_embeds=embeds, attention_mask=None,
        mm_token_type_ids=mm_types,
    )  # fmt: skip
    return embeds, positions


def compare(length: int):
    model = _model()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 190, (1, length), generator=g)
    ids[0, 2] = 202
    ids[0, 3:7] = IMAGE  # a 2 x 2 image
    grid = torch.tensor([[1, 2, 2]])
    pixels = torch.randn(4, 12, generator=g, dtype=torch.float64)
    mm_types = (ids == IMAGE).long()
    weights = torch.randn(1, length, 256, generator=g, dtype=torch.float64)

    def step(logits_of):
        model.zero_grad(set_to_none=True)
        logits = logits_of()
        (logits * weights).sum().backward()
        return logits.detach(), {
            n: p.grad for n, p in model.named_parameters() if p.grad is not None
        }

    kwargs = {"image_grid_thw": grid, "mm_token_type_ids": mm_types, "use_cache": False}
    want = step(lambda: model(input_ids=ids, pixel_values=pixels, **kwargs).logits)
    ringified, run = ringified_run(model)

    def recipe():
        embeds, positions = embedded(model, ids, pixels, grid, mm_types)
        return run(inputs_embeds=embeds, position_ids=positions, use_cache=False).logits

    got = step(recipe)
    assert set(got[1]) == set(want[1])
    return {
        "logits": (got[0] - want[0]).abs().max().item(),
        "grads": max((got[1][n] - want[1][n]).abs().max().item() for n in want[1]),
        "vision grads": len([n for n in got[1] if n.startswith("model.visual")]),
        "gathers": [x.op for x in ringified.report().gathers],
        "rings": len(ringified.report().rewritten),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_recipe_matches_unmodified_model(ranks, world):
    for r in ranks(world).run(compare, 16):
        assert r["logits"] <= TOL and r["grads"] <= TOL, r
        assert r["vision grads"] > 0 and r["rings"] == 2 and r["gathers"] == [], r


def test_whole_model_error_names_the_split():
    from ringify import ringify

    ids = torch.tensor([[1, 2, 202, IMAGE, IMAGE, IMAGE, IMAGE, 3, 4, 5, 6, 7]])
    kwargs = {
        "input_ids": ids,
        "pixel_values": torch.randn(4, 12, dtype=torch.float64),
        "image_grid_thw": torch.tensor([[1, 2, 2]]),
        "mm_token_type_ids": (ids == IMAGE).long(),
        "use_cache": False,
    }
    with pytest.raises(RuntimeError, match=r"failed in the model at .*modeling_qwen2_vl.*tolist"):
        ringify(_model(), ring_size=1)(**kwargs)
