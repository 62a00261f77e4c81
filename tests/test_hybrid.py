"""A hybrid of attention and Mamba2 (HF Bamba) on the ring: exact, its SSM scan gathered.

The attention layers are rings; the Mamba mixer's causal depthwise convolution is a halo
exchange (``ring_conv1d``); its chunked SSM scan has no sequence rule, so its inputs are
gathered and it runs whole on every rank, reported (``benchmarks/hybrid.py`` measures what
that costs). Against the unmodified model on 2 and 4 ranks, float64: logits and every
parameter gradient. Older transformers compute the SSM's decay (``A_log``, ``dt_bias``) in
float32 inside a float64 model; the ring sums their gradients in another order, so each
result is held to the unmodified model's own difference when its batch rows, or each rank's
positions, are back-propagated one at a time and summed (float32 sums in another order,
measured here; 1e-10 where nothing moved).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ringify.passes.report import AttentionRun
from ringify.testing.runs import ringified_run
from ringify.testing.tolerance import differences, exceeding, reordering_tolerances


def compare(world: int, length: int, backend: str | None):
    from transformers import BambaConfig, BambaForCausalLM

    torch.manual_seed(0)
    config = BambaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4,
        mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=16,
        mamba_expand=2, mamba_d_conv=4, use_cache=False,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    model = BambaForCausalLM(config).double()
    ids = torch.randint(1, 64, (2, length), generator=torch.Generator().manual_seed(1))
    weights = torch.randn(2, length, 64, generator=torch.Generator().manual_seed(2))

    def step(fn, rows=slice(None), positions=slice(None)):
        model.zero_grad(set_to_none=True)
        logits = fn(input_ids=ids[rows]).logits
        (logits * weights[rows])[:, positions].sum().backward()
        return {"logits": logits.detach()} | {
            n: p.grad.clone() for n, p in model.named_parameters()
        }

    def summed(parts):
        return {n: parts[0][n] if n == "logits" else sum(p[n] for p in parts) for n in want}

    want = step(model)
    one, other = step(model, slice(0, 1)), step(model, slice(1, 2))
    one_at_a_time = {n: torch.cat([one[n], other[n]]) if n == "logits" else one[n] + other[n]
                     for n in want}  # fmt: skip
    # the ring's own reordering: each rank's positions back-propagated, their sums added
    bounds = [length * r // world for r in range(world + 1)]
    per_rank = summed([step(model, positions=slice(a, b)) for a, b in itertools.pairwise(bounds)])
    ringified, run = ringified_run(model, backend)
    got = step(run)
    report = ringified.report()
    by_rows = reordering_tolerances(want, one_at_a_time)
    by_ranks = reordering_tolerances(want, per_rank)
    tolerances = {n: max(by_rows[n], by_ranks[n]) for n in want}
    return {
        "wrong": exceeding(differences(got, want), tolerances),
        "runs": [a.run for a in report.attentions],
        "gathered": {x.op for x in report.gathers},
        "resharded": [(r.entered, r.gathered) for r in report.resharded],
    }


@pytest.mark.parametrize(
    ("world", "length", "backend"), [(2, 64, None), (4, 61, None), (2, 64, "aot_eager")]
)
def test_bamba_matches_unmodified_model(ranks, world, length, backend):
    for r in ranks(world).run(compare, world, length, backend):
        assert r["wrong"] == {}, r
        assert r["runs"] == [AttentionRun.RING]
        assert r["gathered"] == set(), r
        # the scan's five inputs (x, x * dt, A * dt, B, C) each move onto the heads (dim 2)
        ((entered, whole),) = r["resharded"]
        assert [d for _, d in entered] == [2] * 5 and whole == (), r["resharded"]
