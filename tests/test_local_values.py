"""Every node of a rewritten graph carries its value on a rank (``meta["val"]``).

The pass inserts slices, gathers, reductions over the ring, halo exchanges and ring ops.
After the rewrite each node's ``meta["val"]`` is what a rank holds (``passes/values.py``),
so that structural checks see every node and later FX passes can run. Checked against a
real run on 2 and 4 ranks: every node's real result has the recorded shape, dtype and
device, for models that exercise each kind of insertion.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch.fx._pytree import tree_flatten_spec

from ringify.tracing.trace import state_of


def _case(name: str, length: int):
    from ringify.testing import hf_models, models

    torch.manual_seed(0)
    ids = torch.randint(1, 64, (2, length), generator=torch.Generator().manual_seed(1))
    if name == "llama_padded":  # a mask program, padding by the ring, the label shift, a loss
        mask = torch.ones(2, length, dtype=torch.long)
        mask[1, -3:] = 0
        return hf_models.llama(), {"input_ids": ids, "attention_mask": mask, "labels": ids}
    if name == "nanogpt":  # positions born inside, a cross-entropy over the ring
        return models.NanoGPT(), {"idx": ids, "targets": ids}
    if name == "t5":  # a short decoder's memory attention and replicated self-attention
        return hf_models.t5(), {"input_ids": ids, "labels": ids[:, : length // 2].clone()}
    if name == "mha_weights":  # attention maps: a gather of k, a product kept by rows
        return _WithWeights(), {"x": torch.randn(2, length, 32)}
    raise ValueError(name)


class _WithWeights(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x):
        out, weights = self.attention(x, x, x)
        return out.softmax(1), weights  # a softmax along the sequence, over the ring


class _Checker(fx.Interpreter):
    """Runs the graph for real and compares each node's result with its recorded value."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.missing, self.wrong, self.checked = [], [], 0

    def run_node(self, n: fx.Node):
        result = super().run_node(n)
        if n.op == "output" or isinstance(result, torch.nn.Module):  # a HOP's body
            return result
        if "val" not in n.meta:
            self.missing.append(n.name)
            return result
        got, want = (_described(x) for x in (result, n.meta["val"]))
        self.checked += 1
        if got != want:
            self.wrong.append((n.name, str(n.target), got, want))
        return result


def _described(x):
    if isinstance(x, torch.Tensor):
        return tuple(x.shape), x.dtype, x.device.type
    if isinstance(x, (list, tuple)):
        return tuple(_described(v) for v in x)
    return None  # ints, None, opaque handles: no value to compare


def check_values(name: str, length: int):
    import torch.distributed as dist

    from ringify import ringify

    model, kwargs = _case(name, length)
    model = model.double()
    kwargs = {k: v.double() if v.is_floating_point() else v for k, v in kwargs.items()}
    ringified = ringify(model, ring_size=dist.get_world_size())
    ringified(**kwargs)
    traced = ringified._last()
    checker = _Checker(traced.module)
    flat = tree_flatten_spec(((), kwargs), traced.in_spec)
    checker.run(*state_of(model, traced.state_names), *flat)
    inserted = [n for n in traced.module.graph.nodes if str(n.target).startswith("ringify.")]
    return {
        "missing": checker.missing,
        "wrong": checker.wrong,
        "checked": checker.checked,
        "inserted": len(inserted),
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["llama_padded", "nanogpt", "t5", "mha_weights"])
def test_every_node_has_its_value_on_a_rank(ranks, world, name):
    for r in ranks(world).run(check_values, name, 13):
        assert r["missing"] == [], r["missing"]
        assert r["wrong"] == [], r["wrong"]
        assert r["inserted"] > 0 and r["checked"] > r["inserted"], r
