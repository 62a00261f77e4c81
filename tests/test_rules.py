"""Each sequence-sharding rule on one tiny graph, in one process: placements and rewritten nodes.

A function is traced with torch.export; its first input is sharded along one dim;
the test reads the placement the rules infer for the node of one op (or the
reason it falls back), then runs the rewrite for a ring of 2 (nothing is executed:
the graph is only read) and checks what the rule inserted.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx

from ringify.passes.crossings import PassState
from ringify.passes.placement import Fallback, Geometry, Seq
from ringify.passes.plan import Plan
from ringify.passes.report import GatherReason
from ringify.passes.rules import infer_placements
from ringify.passes.shard_sequence import shard_sequence
from ringify.runtime.ring_reduce import copy_to_ring, reduce_from_ring, ring_amax
from ringify.runtime.ring_scan import ring_cumsum

aten = torch.ops.aten
ringify_ops = torch.ops.ringify
S = 8  # the sequence length of every case


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


def trace(fn, *inputs) -> fx.Graph:
    return torch.export.export(_Fn(fn), inputs, strict=False).module().graph


def node_of(graph: fx.Graph, target) -> fx.Node:
    (node,) = [n for n in graph.nodes if n.target == target]
    return node


def infer(fn, inputs, dim):
    """The graph, and the placements with its first input sharded along ``dim``."""
    graph = trace(fn, *inputs)
    x = next(n for n in graph.nodes if n.op == "placeholder")
    geometry = Geometry(S, S, 2, "contiguous")
    return graph, geometry, x, infer_placements(graph, geometry, {x: Seq(dim)})


def rewrite(graph, geometry, x, dim) -> list:
    """Rewrite for a ring of 2 (inputs already local, outputs left sharded); the node targets."""
    shard_sequence(
        graph,
        plan=Plan({x: Seq(dim)}, geometry),
        group_name="",
        inputs_full=False,
        outputs_full=False,
    )
    return [n.target for n in graph.nodes if n.op == "call_function"]


def x3(*shape):
    return torch.randn(*shape, dtype=torch.float64)


W = x3(4, 6)
CASES = {
    # name: (fn, inputs, sharded dim of input 0, op read, its placement or fallback reason)
    "pointwise": (lambda x: x * 2 + 1, (x3(2, S, 4),), 1, aten.add.Tensor, Seq(1)),
    "broadcast": (lambda x, p: x + p, (x3(2, S, 4), x3(S, 4)), 1, aten.add.Tensor, Seq(1)),
    "mixed dims": (
        lambda x: x + x.transpose(0, 1),
        (x3(S, S, 4),),
        0,
        aten.add.Tensor,
        GatherReason.MIXED_DIMS,
    ),
    "linear": (lambda x: F.linear(x, W.t()), (x3(2, S, 4),), 1, aten.linear.default, Seq(1)),
    "linear over the sequence": (
        lambda x: F.linear(x.transpose(1, 2), x3(3, S)),
        (x3(2, S, 4),),
        1,
        aten.linear.default,
        GatherReason.FEATURE_DIM,
    ),
    "layer_norm": (
        lambda x: F.layer_norm(x, (4,)),
        (x3(2, S, 4),),
        1,
        aten.layer_norm.default,
        Seq(1),
    ),
    "matmul": (lambda x: x @ W, (x3(2, S, 4),), 1, aten.matmul.default, Seq(1)),
    "product over the sequence": (
        lambda x: x.transpose(1, 2) @ x,
        (x3(2, S, 4),),
        1,
        aten.matmul.default,
        GatherReason.PRODUCT,
    ),
    "addmm": (
        lambda x: torch.addmm(x3(6), x, W),
        (x3(S, 4),),
        0,
        aten.addmm.default,
        Seq(0),
    ),
    "cat": (lambda x: torch.cat([x, x], -1), (x3(2, S, 4),), 1, aten.cat.default, Seq(1)),
    "cat along the sequence": (
        lambda x: torch.cat([x, x], 1),
        (x3(2, S, 4),),
        1,
        aten.cat.default,
        GatherReason.CAT_ALONG_SEQUENCE,
    ),
    "embedding": (
        lambda i, w: F.embedding(i, w),
        (torch.randint(0, 5, (2, S)), x3(5, 4)),
        1,
        aten.embedding.default,
        Seq(1),
    ),
    "view keeps the sequence": (
        lambda x: x.view(2, S, 2, 2),
        (x3(2, S, 4),),
        1,
        aten.view.default,
        Seq(1),
    ),
    "view merges batch and sequence": (
        lambda x: x.view(-1, 4),
        (x3(2, S, 4),),
        1,
        aten.view.default,
        Seq(0),
    ),
    "view merges sequence and heads": (
        lambda x: x.reshape(2, -1),
        (x3(2, S, 4),),
        1,
        aten.reshape.default,
        Seq(1, 4),
    ),
    "view splits the sequence": (
        lambda x: x.view(2, 2, S // 2, 4),
        (x3(2, S, 4),),
        1,
        aten.view.default,
        GatherReason.VIEW_SPLITS,
    ),
    "transpose": (lambda x: x.transpose(1, 2), (x3(2, S, 4),), 1, aten.transpose.int, Seq(2)),
    "t": (lambda x: x.t(), (x3(S, 4),), 0, aten.t.default, Seq(1)),
    "permute": (lambda x: x.permute(2, 0, 1), (x3(2, S, 4),), 1, aten.permute.default, Seq(2)),
    "unsqueeze": (lambda x: x.unsqueeze(0), (x3(2, S, 4),), 1, aten.unsqueeze.default, Seq(2)),
    "squeeze": (lambda x: x.squeeze(0), (x3(1, S, 4),), 1, aten.squeeze.dim, Seq(0)),
    "expand": (lambda x: x.expand(2, S, 5), (x3(2, S, 1),), 1, aten.expand.default, Seq(1)),
    "select": (lambda x: x[:, :, 0], (x3(2, S, 4),), 1, aten.select.int, Seq(1)),
    "select along the sequence": (  # taken from the rank that holds it: replicated
        lambda x: x[:, 3],
        (x3(2, S, 4),),
        1,
        aten.select.int,
        None,
    ),
    "last position": (lambda x: x[:, -1:], (x3(2, S, 4),), 1, aten.slice.Tensor, None),
    "a slice longer than a shard": (
        lambda x: x[:, 1:],
        (x3(2, S, 4),),
        1,
        aten.slice.Tensor,
        GatherReason.ALONG_SEQUENCE,
    ),
    "slice": (lambda x: x[..., 1:3], (x3(2, S, 4),), 1, aten.slice.Tensor, Seq(1)),
    "broadcast_to": (
        lambda x: torch.broadcast_to(x, (2, S, 5)),
        (x3(2, S, 1),),
        1,
        aten.broadcast_to.default,
        Seq(1),
    ),
    # Falcon's fused_qkv[..., [-2], :]: a constant index on the head dim
    "index on heads": (
        lambda x: x[..., [-2], :],
        (x3(2, S, 6, 4),),
        1,
        aten.index.Tensor,
        Seq(1),
    ),
    "index on heads, sequence after": (
        lambda x: x[:, torch.tensor([[0, 1]])],
        (x3(2, 3, S, 4),),
        2,
        aten.index.Tensor,
        Seq(3),
    ),
    "index on two dims apart": (
        lambda x: x[torch.tensor([1, 0]), :, torch.tensor([2, 3])],
        (x3(2, S, 4, 4),),
        1,
        aten.index.Tensor,
        Seq(1),
    ),
    "index along the sequence": (
        lambda x: x[:, torch.tensor([0, 2])],
        (x3(2, S, 4),),
        1,
        aten.index.Tensor,
        GatherReason.ALONG_SEQUENCE,
    ),
    "index_select": (
        lambda x: x.index_select(-1, torch.tensor([3, 0])),
        (x3(2, S, 4),),
        1,
        aten.index_select.default,
        Seq(1),
    ),
    "index_select along the sequence": (
        lambda x: x.index_select(1, torch.tensor([3, 0])),
        (x3(2, S, 4),),
        1,
        aten.index_select.default,
        None,
    ),
    "gather": (
        lambda x: x.gather(-1, torch.zeros(2, S, 1, dtype=torch.long)),
        (x3(2, S, 4),),
        1,
        aten.gather.default,
        Seq(1),
    ),
    "gather along the sequence": (
        lambda x: x.gather(1, torch.zeros(2, S, 4, dtype=torch.long)),
        (x3(2, S, 4),),
        1,
        aten.gather.default,
        GatherReason.ALONG_SEQUENCE,
    ),
    "split": (lambda x: x.split(2, -1)[1], (x3(2, S, 4),), 1, aten.split.Tensor, [Seq(1)] * 2),
    "unbind": (lambda x: x.unbind(0)[1], (x3(2, S, 4),), 1, aten.unbind.int, [Seq(0)] * 2),
    "sum over features": (lambda x: x.sum(-1), (x3(2, S, 4),), 1, aten.sum.dim_IntList, Seq(1)),
    "sum over the sequence": (
        lambda x: x.sum(1),
        (x3(2, S, 4),),
        1,
        aten.sum.dim_IntList,
        None,
    ),
    "mean": (lambda x: x.mean(), (x3(2, S, 4),), 1, aten.mean.default, None),
    "amax over the sequence": (lambda x: x.amax(1), (x3(2, S, 4),), 1, aten.amax.default, None),
    "amin over features": (lambda x: x.amin(-1), (x3(2, S, 4),), 1, aten.amin.default, Seq(1)),
    "max of all": (lambda x: x.max(), (x3(2, S, 4),), 1, aten.max.default, None),
    "argmax along the sequence": (
        lambda x: x.argmax(1),
        (x3(2, S, 4),),
        1,
        aten.argmax.default,
        None,
    ),
    "argmax over features": (
        lambda x: x.argmax(-1),
        (x3(2, S, 4),),
        1,
        aten.argmax.default,
        Seq(1),
    ),
    "argmax of all": (
        lambda x: x.argmax(),
        (x3(2, S, 4),),
        1,
        aten.argmax.default,
        GatherReason.ALONG_SEQUENCE,
    ),
    "softmax along the sequence": (
        lambda x: x.softmax(1),
        (x3(2, S, 4),),
        1,
        aten.softmax.int,
        Seq(1),
    ),
    "cross_entropy": (
        lambda x, t: F.cross_entropy(x, t),
        (x3(S, 5), torch.randint(0, 5, (S,))),
        0,
        aten.cross_entropy_loss.default,
        None,
    ),
    "attention": (
        lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True),
        (x3(1, 2, S, 4),),
        2,
        aten.scaled_dot_product_attention.default,
        Seq(2),
    ),
    "cross-attention to a replicated memory": (
        lambda q, m: F.scaled_dot_product_attention(q, m, m),
        (x3(1, 2, S, 4), x3(1, 2, 3, 4)),
        2,
        aten.scaled_dot_product_attention.default,
        Seq(2),
    ),
    "causal cross-attention": (
        lambda q, m: F.scaled_dot_product_attention(q, m, m, is_causal=True),
        (x3(1, 2, S, 4), x3(1, 2, 3, 4)),
        2,
        aten.scaled_dot_product_attention.default,
        GatherReason.CAUSAL_MEMORY,
    ),
    "replicated queries to a sharded memory": (  # replicated: memory_attention
        lambda kv, m: F.scaled_dot_product_attention(m, kv, kv),
        (x3(1, 2, S, 4), x3(1, 2, 3, 4)),
        2,
        aten.scaled_dot_product_attention.default,
        None,
    ),
    "sharded queries, one of k and v sharded": (
        lambda q, m: F.scaled_dot_product_attention(q, q, m),
        (x3(1, 2, S, 4), x3(1, 2, S, 4)),
        2,
        aten.scaled_dot_product_attention.default,
        GatherReason.QKV_NOT_SHARDED,
    ),
    "cumsum along the sequence": (
        lambda x: x.cumsum(1),
        (x3(2, S, 4),),
        1,
        aten.cumsum.default,
        Seq(1),
    ),
    "cumsum over features": (
        lambda x: x.cumsum(-1),
        (x3(2, S, 4),),
        1,
        aten.cumsum.default,
        Seq(1),
    ),
    "cumsum over sequence and heads": (
        lambda x: x.reshape(2, -1).cumsum(1),
        (x3(2, S, 4),),
        1,
        aten.cumsum.default,
        GatherReason.ALONG_SEQUENCE,
    ),
    "no rule": (
        lambda x: x.cummax(1)[0],
        (x3(2, S, 4),),
        1,
        aten.cummax.default,
        GatherReason.NO_RULE,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_inferred_placement(case):
    fn, inputs, dim, target, want = CASES[case]
    graph, _, _, inference = infer(fn, inputs, dim)
    decided = inference.decisions[node_of(graph, target)]
    if isinstance(want, GatherReason):
        assert isinstance(decided, Fallback) and decided.reason is want, decided
    else:
        assert decided == want


def test_a_replicated_operand_that_lines_up_is_a_meeting():
    """The meetings are how labels and positions are found: here p (S, 4) against x's sequence."""
    graph, _, _, inference = infer(lambda x, p: x + p, (x3(2, S, 4), x3(S, 4)), 1)
    p = [n for n in graph.nodes if n.op == "placeholder"][1]
    assert (p, Seq(0)) in inference.place.meetings


def targets_after(case):
    fn, inputs, dim, *_ = CASES[case]
    graph, geometry, x, _ = infer(fn, inputs, dim)
    return graph, rewrite(graph, geometry, x, dim)


def test_weights_go_through_copy_to_ring():
    graph, _targets = targets_after("linear")
    linear = node_of(graph, aten.linear.default)
    assert linear.args[1].target is copy_to_ring


def test_broadcast_operand_that_lines_up_is_sliced():
    graph, _ = targets_after("broadcast")
    operand = node_of(graph, aten.add.Tensor).args[1]
    assert operand.target is aten.reshape.default  # of take_shard's output
    assert operand.args[0].target is ringify_ops.take_shard.default


@pytest.mark.parametrize(
    ("case", "local"),
    [("view keeps the sequence", [2, S // 2, 2, 2]), ("view merges batch and sequence", [S, 4])],
)
def test_views_get_local_sizes(case, local):
    graph, _ = targets_after(case)
    (view,) = [n for n in graph.nodes if n.target is aten.reshape.default]
    assert view.args[1] == local


@pytest.mark.parametrize(
    ("case", "op"), [("expand", aten.expand.default), ("broadcast_to", aten.broadcast_to.default)]
)
def test_expand_gets_local_size(case, op):
    graph, _ = targets_after(case)
    assert node_of(graph, op).args[1] == [2, S // 2, 5]


def test_gather_slices_a_replicated_index_that_lines_up():
    graph, _ = targets_after("gather")
    index = node_of(graph, aten.gather.default).args[2]
    assert index.target is aten.reshape.default  # of take_shard's output
    assert index.args[0].target is ringify_ops.take_shard.default


@pytest.mark.parametrize(
    ("case", "count"), [("sum over the sequence", 1), ("mean", 1), ("cross_entropy", 2)]
)
def test_reductions_over_the_sequence_reduce_over_the_ring(case, count):
    _, targets = targets_after(case)
    assert targets.count(reduce_from_ring) == count  # cross-entropy: loss and target count


def test_attention_becomes_the_ring_op_with_its_fake_value():
    graph, targets = targets_after("attention")
    assert aten.scaled_dot_product_attention.default not in targets
    ring = node_of(graph, ringify_ops.ring_attention.default)
    out, lse = ring.meta["val"]
    assert tuple(out.shape) == (1, 2, S, 4) and out.dtype == torch.float64
    assert tuple(lse.shape) == (1, 2, S) and lse.dtype == torch.float64
    (out_node,) = ring.users  # the unused lse is dead code, removed
    assert out_node.target is operator.getitem and out_node.args[1] == 0
    assert out_node.meta["val"].shape == out.shape


def test_a_fallback_gathers_its_sharded_inputs():
    graph, _targets = targets_after("no rule")
    cummax = node_of(graph, aten.cummax.default)
    assert cummax.args[0].target is aten.reshape.default
    assert cummax.args[0].args[0].target is ringify_ops.gather.default


@pytest.mark.parametrize("case", ["amax over the sequence", "max of all"])
def test_maxima_over_the_sequence_become_ring_amax(case):
    _, targets = targets_after(case)
    assert targets.count(ring_amax) == 1 and aten.amax.default not in targets


def test_softmax_along_the_sequence_normalises_over_the_ring():
    _, targets = targets_after("softmax along the sequence")
    assert aten.softmax.int not in targets
    assert targets.count(ring_amax) == 1 and targets.count(reduce_from_ring) == 1
    assert targets.count(copy_to_ring) == 1  # the total's gradient is summed over the ring


def test_cumsum_along_the_sequence_becomes_the_ring_scan():
    graph, _ = targets_after("cumsum along the sequence")
    (scan,) = [n for n in graph.nodes if n.target is ring_cumsum]
    assert scan.args[1:] == (1, "", "contiguous")


def test_state_crossings_are_inserted_once():
    graph, geometry, _x, inference = infer(lambda x, p: x + p, (x3(2, S, 4), x3(S, 4)), 1)
    state = PassState(graph, geometry, "", dict(inference.place.of))
    p = [n for n in graph.nodes if n.op == "placeholder"][1]
    assert state.slice(p, Seq(0), 0) is state.slice(p, Seq(0), 0)
    assert state.copy_to_ring(p) is state.copy_to_ring(p)
    assert state.place[state.slice(p, Seq(0), 0)] == Seq(0)
