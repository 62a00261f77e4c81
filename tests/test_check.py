"""``ringify.check``: the user's self-check on forked gloo ranks, against the unmodified model.

It passes on a model the pass shards exactly, in float64 and with a measured float32 bound;
it fails when a sharding rule is broken on purpose (the rule is patched in this process
before the check forks its ranks, which inherit it); it raises ringify's own clear error for
a model ringify refuses; and it refuses modes it cannot compare.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ringify
from ringify.passes.graph.crossings import Rule, as_it_is
from ringify.passes.sharding import rules
from ringify.testing.generated import BlockSpec, ModelSpec, build, example

aten = torch.ops.aten
POOLED = ModelSpec("tokens", 16, 12, 2, (BlockSpec(hidden=12, mask="causal"),), pool="mean")


def test_a_model_sharded_exactly_passes():
    spec = ModelSpec("patches", 16, 16, 1, (BlockSpec(hidden=16),), prefix=1, pool="first")
    checked = ringify.check(build(spec), *example(spec), ring_size=2)
    assert checked.passed, str(checked)
    kinds = {r.kind for r in checked.rows}
    assert kinds == {"output", "gradient"}
    assert len(checked.rows) == 1 + len(list(build(spec).parameters()))
    assert max(r.max_diff for r in checked.rows) < 1e-12
    assert checked.report.ring_size == 2 and not checked.report.gathers


def test_a_broken_rule_fails_the_check(monkeypatch):
    """The mean over the sequence left local (no sum over the ring): each rank's mean of its
    own positions. The check sees the output and every gradient behind it differ."""
    broken = Rule(rules.RULES[aten.mean.dim].infer, as_it_is)
    monkeypatch.setitem(rules.RULES, aten.mean.dim, broken)
    model = build(POOLED).float()
    (ids,) = example(POOLED)
    checked = ringify.check(model, ids, ring_size=2)
    assert not checked.passed
    assert "output" in {r.name for r in checked.failed}
    assert checked.failed[0].max_diff > 1e3 * checked.failed[0].bound


def test_a_measured_bound_in_float32():
    model = build(POOLED).float()
    (ids,) = example(POOLED)
    checked = ringify.check(model, ids, ring_size=3, dtype=torch.float32)
    assert checked.passed, str(checked)
    assert checked.dtype is torch.float32
    assert all(r.bound > 0 for r in checked.rows)
    assert next(p for p in model.parameters()).dtype is torch.float32  # the model untouched


def test_dropout_is_compared_at_zero():
    """Dropout 0.1 on the sequence and on the pooled features: the ranks draw their own
    masks, so the check runs every dropout at p = 0 and compares exactly."""
    spec = dataclasses.replace(
        POOLED, blocks=(BlockSpec(hidden=12, dropout=0.1),), head_dropout=0.1, pool="first"
    )
    checked = ringify.check(build(spec), *example(spec), ring_size=2)
    assert checked.passed, str(checked)


def test_a_refused_model_raises_ringifys_error():
    class Flat(torch.nn.Module):  # 3-D q, k and v: ringify shards 4-D attention only
        def forward(self, x):
            return torch.nn.functional.scaled_dot_product_attention(x, x, x)

    with pytest.raises(ValueError, match="4-D"):
        ringify.check(Flat(), torch.randn(2, 8, 4), ring_size=2)


@pytest.mark.parametrize("option", ["inputs", "outputs", "group"])
def test_modes_it_cannot_compare_are_refused(option):
    with pytest.raises(ValueError, match="leave"):
        ringify.check(build(POOLED), *example(POOLED), ring_size=2, **{option: "sharded"})


def test_dilation_is_refused():
    """Dilated attention is another attention than the model's: nothing to compare with."""
    from ringify.runtime import Dilation

    with pytest.raises(ValueError, match="dilation"):
        ringify.check(build(POOLED), *example(POOLED), ring_size=2, dilation=Dilation((8,), (2,)))


@pytest.mark.slow
def test_compiled_with_inductor():
    spec = ModelSpec("patches", 16, 16, 1, (BlockSpec(hidden=16),), prefix=1, pool="mean")
    checked = ringify.check(build(spec), *example(spec), ring_size=2, compile="inductor")
    assert checked.passed, str(checked)
    assert checked.compiled == "inductor"
