"""``ringify.estimate``: memory per GPU read from the traced graph, checked against the peak a
real step measures on gloo ranks (slow); the table, the command and the errors (fast, on the
meta device: nothing of the model's size allocated), for models built from transformers
configs."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn

from ringify.estimate import NoMeshFits, estimate
from ringify.estimate.__main__ import main
from ringify.estimate.footprint import causal_lm_inputs, footprint
from ringify.testing.process_memory import resident_bytes
from ringify.testing.sizing import CASES, LLAMA_8B, measured_and_estimated


def _config(tmp_path, **changes) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_8B | changes))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_estimated_memory_is_within_15_percent_of_the_measured_peak(ranks, case):
    """Weights, gradients, activations and the transport's buffers per rank, against the
    rank's measured peak, at two lengths (HF Llama without and with checkpointing and beside
    TP, Qwen3-MoE, Bamba, SD3; 2 and 4 ranks)."""
    ring, tp, _, _ = CASES[case]
    for length in (0, 1):
        for r in ranks(ring * tp).run(measured_and_estimated, case, length, timeout=600):
            assert r["gathers"] == 0, r
            assert abs(r["estimated"] / r["measured"] - 1) <= 0.15, r


def test_the_table_puts_fitting_meshes_first_and_marks_autos_pick(tmp_path):
    result = estimate(_config(tmp_path, num_hidden_layers=2), 262144, 16, gpu="h100-80gb")
    fits = [result.fits(r) for r in result.rows]
    assert fits[0] and fits == sorted(fits, reverse=True)
    fitting = [r for r in result.rows if result.fits(r)]
    speeds = [r.tokens_per_gpu for r in fitting]
    assert speeds == sorted(speeds, reverse=True)
    for r in result.rows:
        assert r.mesh.dp * r.mesh.tp * r.mesh.cp == 16
        # checkpointing only where it keeps less (chosen where the step would not fit)
        assert not r.checkpointing or r.activations < r.activations_other
    assert any(r.auto for r in result.rows)
    assert "(auto)" in result.table(len(result.rows))
    assert result.why(0).count("\n") >= 6


def test_memory_scales_with_the_ring_and_tp_splits_the_heads(tmp_path):
    """Activations fall as 1/cp; TP narrows the activations inside the blocks."""
    result = estimate(_config(tmp_path, num_hidden_layers=2), 131072, 8, gpu="h200")
    by_mesh = {(r.mesh.dp, r.mesh.tp, r.mesh.cp, r.mesh.strategy): r for r in result.rows}
    one, two = by_mesh[2, 1, 4, "ring"], by_mesh[1, 1, 8, "ring"]
    tp = by_mesh[1, 2, 4, "ring"]
    assert not (one.checkpointing or two.checkpointing or tp.checkpointing)
    assert one.activations == pytest.approx(2 * two.activations, rel=1e-6)
    assert tp.activations < one.activations


def test_a_tp_footprint_holds_its_ranks_heads(tmp_path):
    from ringify.estimate import _module

    module = _module(_config(tmp_path, num_hidden_layers=2), torch.bfloat16)
    whole = footprint(module, causal_lm_inputs(), tp=1)
    split = footprint(module, causal_lm_inputs(), tp=8)
    assert [(a.heads, a.kv_heads) for a in whole.attentions] == [(32, 8)] * 2
    assert [(a.heads, a.kv_heads) for a in split.attentions] == [(4, 1)] * 2
    assert split.flops.per_position < whole.flops.per_position / 4
    assert whole.tp_split == 0 and 0 < split.tp_split <= split.parameters


def test_an_8b_model_at_1m_tokens_allocates_nothing_of_its_size(tmp_path):
    """Eight layers of Llama-3-8B: 3.5 G parameters, 7 GB in bf16; the estimate's process
    grows by far less."""
    before = resident_bytes()
    result = estimate(_config(tmp_path, num_hidden_layers=8), 1 << 20, 64)
    assert result.rows and result.fits(result.rows[0])
    assert resident_bytes() - before < 1 << 30


def test_a_length_no_mesh_fits_names_what_does(tmp_path):
    config = _config(tmp_path, num_hidden_layers=2)
    with pytest.raises(NoMeshFits) as caught:
        estimate(config, 1 << 24, 8)
    need, longest = caught.value.gpus_needed, caught.value.longest
    assert need is not None and need > 8 and 0 < longest < 1 << 24
    assert estimate(config, 1 << 24, need).rows  # it does fit there
    assert estimate(config, longest, 8).rows


@pytest.mark.parametrize("gpus, gpu", [(12, "h100-80gb"), (0, "h100-80gb"), (8, "h100-8000gb")])
def test_bad_input_is_refused(tmp_path, gpus, gpu):
    with pytest.raises(ValueError):
        estimate(_config(tmp_path, num_hidden_layers=2), 8192, gpus, gpu=gpu)


def test_memory_growing_faster_than_the_sequence_is_reported(caplog):
    """A handwritten attention keeps its (S x S) scores: the probes bend, and the estimate
    says so."""

    class Handwritten(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.proj(x).chunk(3, dim=-1)
            return torch.softmax(q @ k.transpose(-1, -2), -1) @ v

    def inputs(n):
        return {"x": torch.zeros(1, n, 16, device="meta")}

    with caplog.at_level(logging.WARNING, logger="ringify"):
        estimate(Handwritten(), 4096, 2, inputs=inputs)
    assert any(r.name == "ringify" and r.levelno == logging.WARNING for r in caplog.records)


def test_the_command(tmp_path, capsys):
    config = _config(tmp_path, num_hidden_layers=2)
    assert main(["--config", config, "--seq", "65536", "--gpus", "8", "--why", "0"]) == 0
    assert main(["--config", config, "--seq", "65536", "--gpus", "8", "--gpu", "tpu"]) == 2


def test_mla_and_routed_experts_are_traced_with_their_heads_and_checkpointed():
    """HF DeepSeek-V3 (MLA: q/k head dim 48, v 32; a dense layer, then routed and shared
    experts), its KV cache left out as in training: every block recomputes under the
    checkpoint, and each attention is read with its own head dims."""
    from ringify.estimate import _module

    config = dict(
        model_type="deepseek_v3", hidden_size=256, intermediate_size=512,
        moe_intermediate_size=64, num_hidden_layers=2, first_k_dense_replace=1,
        n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
        n_shared_experts=1, num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=64,
        q_lora_rank=96, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
        vocab_size=1000,
    )  # fmt: skip
    fp = footprint(_module(config, torch.bfloat16), causal_lm_inputs())
    assert [(a.heads, a.head_dim, a.v_head_dim) for a in fp.attentions] == [(8, 48, 32)] * 2
    assert 0 < fp.checkpointed.per_position < fp.activations.per_position
