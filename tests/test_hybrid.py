"""Hybrids of attention and a scan on the ring: exact, and nothing gathered.

HF Bamba (Mamba2) and Jamba (Mamba1, with MoE), and the rest of each class. The attention
layers are rings; a mixer's causal depthwise convolution is a halo exchange
(``ring_conv1d``). A Mamba2 or delta-rule scan has no sequence rule, but keeps heads
independent, so its inputs move onto a share of them by one all-to-all each and it runs on
every position there (``passes/sharding/resharded.py``). Mamba1's recurrence, unrolled over the
positions by export, is folded into one selective scan that passes its state round the
ring (``passes/folds/scans.py``). Against the unmodified model on 2 and 4 ranks, float64: logits and every
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

from ringify.passes.graph.report import AttentionRun
from ringify.runtime.selective_scan import ring_selective_scan
from ringify.testing.runs import ringified_run
from ringify.testing.tolerance import differences, exceeding, reordering_tolerances
from ringify.tracing.lengths import SMALL_FIRST


def hybrid(family: str):
    import transformers as tf

    mamba = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, use_cache=False)
    common = mamba | dict(intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    if family.startswith("bamba"):
        # "bamba-square": B and C as wide as x (state = head dim), so that the scan reshapes
        # equal shapes to different ones (DTensor's answers are cached by op and arguments)
        config = tf.BambaConfig(
            **common, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16,
            mamba_n_groups=1, mamba_d_state=16 if family == "bamba-square" else 8,
            mamba_chunk_size=16, mamba_expand=2, mamba_d_conv=4,
        )  # fmt: skip
        return tf.BambaForCausalLM, config
    if family == "jamba":
        config = tf.JambaConfig(
            **common, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
            expert_layer_offset=1, num_experts=2, mamba_d_state=8, mamba_d_conv=4,
            mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False,
        )  # fmt: skip
        return tf.JambaForCausalLM, config
    if family == "falconh1":
        config = tf.FalconH1Config(
            **common, head_dim=8, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
            mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=16,
            mamba_expand=2,
        )  # fmt: skip
        return tf.FalconH1ForCausalLM, config
    if family == "nemotronh":
        config = tf.NemotronHConfig(
            **common | dict(num_hidden_layers=3), hybrid_override_pattern="M*-", head_dim=8,
            mamba_num_heads=4, mamba_head_dim=16, n_groups=1, ssm_state_size=8, conv_kernel=4,
            chunk_size=16, expand=2,
        )  # fmt: skip
        return tf.NemotronHForCausalLM, config
    if family == "granitemoehybrid":
        config = tf.GraniteMoeHybridConfig(
            **common, layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16,
            mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=16,
            mamba_expand=2, num_local_experts=2, num_experts_per_tok=1,
            shared_intermediate_size=32,
        )  # fmt: skip
        return tf.GraniteMoeHybridForCausalLM, config
    if family == "lfm2":
        config = tf.Lfm2Config(**common, layer_types=["conv", "full_attention"])
        return tf.Lfm2ForCausalLM, config
    if family == "qwen3next":
        config = tf.Qwen3NextConfig(
            **common, head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
            shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention"],
            mlp_only_layers=[0, 1],  # dense MLPs: a router's float32 ties would blur the rounding
        )  # fmt: skip
        return tf.Qwen3NextForCausalLM, config
    if family == "qwen3_5":
        config = tf.Qwen3_5TextConfig(
            **common, head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention"],
        )  # fmt: skip
        return tf.Qwen3_5ForCausalLM, config
    if family == "recurrent_gemma":  # RG-LRU, a diagonal linear RNN, beside local attention
        config = tf.RecurrentGemmaConfig(
            **common | dict(num_key_value_heads=4), head_dim=8, lru_width=32,
            attention_window_size=16, conv1d_width=4, block_types=("recurrent", "attention"),
        )  # fmt: skip
        return tf.RecurrentGemmaForCausalLM, config
    if family == "minimax":  # lightning attention: a decaying linear attention in blocks
        config = tf.MiniMaxConfig(
            **common, head_dim=8, layer_types=["linear_attention", "full_attention"],
            block_size=8, num_local_experts=2, num_experts_per_tok=1,
        )  # fmt: skip
        return tf.MiniMaxForCausalLM, config
    if family == "mamba":
        config = tf.MambaConfig(**mamba, state_size=8, expand=2, conv_kernel=4, use_mambapy=False)
        return tf.MambaForCausalLM, config
    if family == "falcon_mamba":
        config = tf.FalconMambaConfig(**mamba, state_size=8, expand=2, conv_kernel=4)
        return tf.FalconMambaForCausalLM, config
    if family == "zamba":  # its shared attention block in layers 2 and 5 (its tied weights')
        config = tf.ZambaConfig(
            **common | dict(num_hidden_layers=6, num_key_value_heads=4), attn_layer_period=3,
            attn_layer_offset=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
            mamba_dt_rank=4, n_mamba_heads=2,
        )  # fmt: skip
        return tf.ZambaForCausalLM, config
    config = tf.Mamba2Config(
        **mamba, state_size=8, expand=2, conv_kernel=4, num_heads=4, head_dim=16, n_groups=1,
        chunk_size=16,
    )  # fmt: skip
    return tf.Mamba2ForCausalLM, config


def compare(world: int, length: int, backend: str | None, family: str = "bamba", batch: int = 2):
    torch.manual_seed(0)
    cls, config = hybrid(family)
    if family not in NO_ATTENTION:
        config._attn_implementation = "sdpa"
    config.use_cache = False
    config._experts_implementation = "batched_mm"  # grouped_mm takes no float64
    model = cls(config).double()
    ids = torch.randint(1, 64, (batch, length), generator=torch.Generator().manual_seed(1))
    weights = torch.randn(batch, length, 64, generator=torch.Generator().manual_seed(2))

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
    rows = [step(model, slice(i, i + 1)) for i in range(batch)]
    one_at_a_time = {n: torch.cat([r[n] for r in rows]) if n == "logits" else sum(r[n] for r in rows)
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
    if computes_in_float32(model, ids):  # Qwen3-Next's delta rule; older Mamba2's decay
        tolerances = {n: max(tolerances[n], t) for n, t in float32_rounding(model, step).items()}
    return {
        "wrong": exceeding(differences(got, want), tolerances),
        "runs": [a.run for a in report.attentions],
        "gathered": [x.node for x in report.gathers],
        "resharded": [(r.entered, r.gathered) for r in report.resharded],
        "header": [line for line in ringified.graph_diff().splitlines() if line.startswith("# ")],
        "placements": report.placements(),
        "state passing": sum(
            n.target is ring_selective_scan for n in ringified._last().module.graph.nodes
        ),
        "traces": ringified.traces,
        "lengths": report.lengths,
    }


def computes_in_float32(model, ids) -> bool:
    """Whether the float64 model computes any op in float32 (casts inside it), seen op by op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        found = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            leaves = torch.utils._pytree.tree_leaves(out)
            Seen.found |= any(getattr(t, "dtype", None) == torch.float32 for t in leaves)
            return out

    with torch.no_grad(), Seen():
        model(input_ids=ids)
    return Seen.found


def float32_rounding(model, step) -> dict:
    """The model's own float32 rounding on this input, measured: each result of the whole
    model in float32 against float64 (the same weights). A model that computes parts of
    itself in float32 whatever its dtype is held to it."""
    want = step(model)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    model.float()
    try:
        rounded = step(model)
    finally:
        model.double().load_state_dict(saved)
    return differences(rounded, want)


# each scan's inputs, the dim each enters on, how many stay gathered, and how many scans:
# Mamba2's five (x, x * dt, A * dt, B, C) on the heads; Mamba1's recurrence is folded into
# one scan that passes its state round the ring (nothing moved; ``STATE_PASSING``); LFM2's
# short convolutions are halo exchanges; Qwen3-Next's q, k, v, beta and g on the heads
MAMBA2 = ([2] * 5, 0, 1)
ENTERED = {
    ("bamba", 2): MAMBA2, ("bamba-square", 1): MAMBA2, ("falconh1", 1): ([2] * 5, 0, 2), ("nemotronh", 1): MAMBA2,
    ("granitemoehybrid", 1): MAMBA2, ("mamba2", 2): ([2] * 5, 0, 2), ("lfm2", 1): ([], 0, 0),
    ("jamba", 2): ([], 0, 0), ("jamba", 1): ([], 0, 0), ("mamba", 1): ([], 0, 0),
    ("falcon_mamba", 1): ([], 0, 0), ("zamba", 1): ([], 0, 0), ("recurrent_gemma", 1): ([], 0, 0),
    ("recurrent_gemma", 2): ([], 0, 0),
    ("qwen3next", 1): ([1] * 5, 0, 1), ("qwen3_5", 1): ([1] * 5, 0, 1),
    ("minimax", 1): ([1] * 3, 0, 1),
}  # fmt: skip
# Mamba1 mixers: one selective scan each (Zamba's: one per mixer head, 2 heads in 6 layers)
STATE_PASSING = {"jamba": 1, "mamba": 2, "falcon_mamba": 2, "zamba": 12, "recurrent_gemma": 1}
NO_ATTENTION = ("mamba", "mamba2", "falcon_mamba")


@pytest.mark.parametrize(
    ("world", "length", "backend"),
    [
        (2, 64, None), (4, 61, None), (2, 64, "aot_eager"),
        pytest.param(2, 64, "inductor", marks=pytest.mark.slow),
    ],
)  # fmt: skip
def test_bamba_matches_unmodified_model(ranks, world, length, backend):
    check(ranks(world).run(compare, world, length, backend), "bamba", 2)


@pytest.mark.parametrize(
    ("family", "batch", "world", "length"),
    [
        ("jamba", 2, 2, 24), ("jamba", 1, 4, 30), ("mamba", 1, 2, 24), ("mamba2", 2, 4, 45),
        ("falcon_mamba", 1, 4, 30), ("zamba", 1, 2, 24),
        ("falconh1", 1, 2, 32), ("nemotronh", 1, 2, 32), ("granitemoehybrid", 1, 2, 32),
        ("lfm2", 1, 2, 32), ("qwen3next", 1, 2, 32), ("qwen3_5", 1, 2, 32),
        ("bamba-square", 1, 2, 32), ("recurrent_gemma", 1, 2, 40), ("recurrent_gemma", 2, 4, 37),
        ("minimax", 1, 2, 32), ("minimax", 1, 4, 37),
    ],
)  # fmt: skip
def test_scans_on_a_share_of_their_heads(ranks, family, batch, world, length):
    """Jamba (Mamba1 unrolled over the positions, with MoE); FalconH1, Nemotron-H and
    GraniteMoeHybrid (Mamba2 beside attention, one sequence); LFM2 (short convolutions);
    Qwen3-Next (Gated DeltaNet, its region cut before the gated norm that merges the heads
    with the positions); RecurrentGemma (its RG-LRU, unrolled over the positions and
    written into a buffer, folded into a selective scan with a state per channel); MiniMax
    (lightning attention, its blocks unrolled by export, one region on a share of the
    heads); and models with no attention at all: HF Mamba and Mamba2, their sequence
    followed from the token ids."""
    check(ranks(world).run(compare, world, length, None, family, batch), family, batch)


def test_mamba1_scan_under_aot_autograd(ranks):
    """Jamba's folded scan and its state passing traced by AOTAutograd (aot_eager)."""
    check(ranks(2).run(compare, 2, 24, "aot_eager", "jamba", 1), "jamba", 1)


def check(results: list, family: str, batch: int) -> None:
    dims, gathered, scans = ENTERED[family, batch]
    for r in results:
        assert r["wrong"] == {}, r
        assert set(r["runs"]) == (set() if family in NO_ATTENTION else {AttentionRun.RING}), r
        assert len(r["resharded"]) == scans, r
        assert r["state passing"] == STATE_PASSING.get(family, 0), r
        for entered, whole in r["resharded"]:  # every layer's scan alike
            assert [d for _, d in entered] == dims and len(whole) == gathered, r["resharded"]
        assert len(r["gathered"]) == gathered * scans, r  # reported once per input left whole
        # graph_diff opens with a line per attention, region on a share and gather
        assert r["header"] == [f"# {line}" for line in r["placements"]], r["header"]
        assert len(r["header"]) == len(r["runs"]) + scans + len(r["gathered"]), r["header"]


@pytest.mark.parametrize("family", ["mamba", "jamba"])
def test_a_long_first_call_is_traced_at_small_lengths(ranks, family):
    """Export unrolls Mamba1's recurrence over the positions (about 15 ms per position and
    layer): a first call of SMALL_FIRST positions or more is traced at four small lengths,
    and the graph the pass folded runs at the call's own length (odd here: padded). Exact,
    one trace, the report says so."""
    results = ranks(2).run(compare, 2, SMALL_FIRST + 3, None, family, 1, timeout=600)
    check(results, family, 1)
    for r in results:
        assert r["traces"] == 1 and "traced at small lengths" in r["lengths"], r


def second_length(family: str) -> tuple[str, float]:
    torch.manual_seed(0)
    cls, config = hybrid(family)
    model = cls(config).double()
    ringified, run = ringified_run(model, None)
    worst = 0.0
    for length in (24, 30):
        ids = torch.randint(1, 64, (1, length), generator=torch.Generator().manual_seed(length))
        worst = max(worst, (run(input_ids=ids).logits - model(input_ids=ids).logits).abs().max())
    return ringified.report().lengths, float(worst)


def test_a_second_short_length_of_an_unrolled_loop_is_traced_anew(ranks):
    """Below SMALL_FIRST, a second length of HF Mamba: its symbolic export fixes the length
    (the loop over the positions), so each length is traced anew, exact."""
    for lengths, worst in ranks(2).run(second_length, "mamba"):
        assert lengths.startswith("per length: the export fixed the length"), lengths
        assert worst < 1e-10, worst


def observed_long_first_call() -> dict:
    """HF Mamba with a user's hook that logs a mixer's output, on a long first call: the
    op count on fake tensors would call the hook, so export's own graphs are counted."""
    torch.manual_seed(0)
    cls, config = hybrid("mamba")
    model = cls(config).double()
    seen = []
    model.backbone.layers[0].mixer.register_forward_hook(
        lambda module, args, output: seen.append(type(output).__name__)
    )
    ringified, run = ringified_run(model, None)
    length = SMALL_FIRST + 3
    ids = torch.randint(1, 64, (1, length), generator=torch.Generator().manual_seed(0))
    seen.clear()
    worst = (run(input_ids=ids).logits - model(input_ids=ids).logits).abs().max()
    return {"lengths": ringified.report().lengths, "traces": ringified.traces,
            "error": float(worst), "seen": seen}  # fmt: skip


def test_a_long_first_call_with_a_users_hook_is_traced_at_small_lengths(ranks):
    for r in ranks(2).run(observed_long_first_call, timeout=600):
        assert r["traces"] == 1 and "traced at small lengths" in r["lengths"], r
        assert r["error"] < 1e-10, r
        # the ringified call (on its shard), then the unmodified model's: real tensors both
        assert r["seen"][-2:] == ["Tensor", "Tensor"], r
