"""Each local sequence-sharding rule on one tiny graph: pointwise, views, indexing, fallbacks.

The rules that talk over the ring (reductions, scans, shifts, attention) are in
test_ring_rules.py; the graphs are built by rule_graphs.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rule_graphs import S, check_inferred, infer, node_of, targets_after, x3

from ringify.passes.graph.crossings import PassState, Rule, as_it_is
from ringify.passes.graph.placement import Fallback, Seq, SequenceGeometry, view_placement
from ringify.passes.graph.report import STRICT, GatherReason
from ringify.passes.sharding import rules
from ringify.runtime.collectives.reduce import copy_to_ring

aten = torch.ops.aten
ringify_ops = torch.ops.ringify
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
    # elementwise ops whose overloads torch leaves without the pointwise tag
    "log_sigmoid": (F.logsigmoid, (x3(2, S, 4),), 1, aten.log_sigmoid.default, Seq(1)),
    "hardswish": (F.hardswish, (x3(2, S, 4),), 1, aten.hardswish.default, Seq(1)),
    "where, a scalar other": (
        lambda x: torch.where(x > 0, x, 0.5),
        (x3(2, S, 4),),
        1,
        aten.where.ScalarOther,
        Seq(1),
    ),
    "where, scalars": (
        lambda x: torch.where(x > 0, 1.0, 0.5),
        (x3(2, S, 4),),
        1,
        aten.where.Scalar,
        Seq(1),
    ),
    "masked_fill, a tensor value": (
        lambda x, v: x.masked_fill(x > 0, v),
        (x3(2, S, 4), torch.tensor(0.5, dtype=torch.float64)),
        1,
        aten.masked_fill.Tensor,
        Seq(1),
    ),
    "rsub of tensors": (
        lambda x, p: torch.rsub(x, p),
        (x3(2, S, 4), x3(S, 4)),
        1,
        aten.rsub.Tensor,
        Seq(1),
    ),
    "logsumexp over features": (  # a router's, over its experts
        lambda x: torch.logsumexp(x, -1, keepdim=True),
        (x3(2, S, 4),),
        1,
        aten.logsumexp.default,
        Seq(1),
    ),
    "logsumexp over the sequence": (
        lambda x: torch.logsumexp(x, 1),
        (x3(2, S, 4),),
        1,
        aten.logsumexp.default,
        GatherReason.REDUCED_SEQUENCE,
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
    "cat of whole sequences": (  # each rank's positions of each, end to end (an MoE's aux loss)
        lambda x: torch.cat([x, x], 1),
        (x3(2, S, 4),),
        1,
        aten.cat.default,
        Seq(1),
    ),
    "cat along the sequence": (
        lambda x: torch.cat([x, x[:, :3]], 1),
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
    "view splits the sequence into rows": (  # 2 rows of 4: each rank's chunk is one row
        lambda x: x.view(2, 2, S // 2, 4),
        (x3(2, S, 4),),
        1,
        aten.view.default,
        Seq(1, 1, S // 2),
    ),
    "type_as reads a dtype": (  # the other tensor, sharded along another dim, gives a dtype
        lambda x: x.type_as(x.transpose(0, 1)),
        (x3(S, S, 4),),
        0,
        aten.type_as.default,
        Seq(0),
    ),
    "repeat along other dims": (
        lambda x: x.repeat(3, 1, 2),
        (x3(2, S, 4),),
        1,
        aten.repeat.default,
        Seq(1),
    ),
    "repeat along the sequence": (  # each copy all the positions: more outer blocks
        lambda x: x.repeat(1, 2, 1),
        (x3(2, S, 4),),
        1,
        aten.repeat.default,
        Seq(1),
    ),
    "a replicated part written into a sharded base": (  # the part sliced to this rank's rows
        lambda x, p: torch.slice_scatter(x, p, dim=2, start=0, end=2),
        (x3(2, S, 4), x3(2, S, 2)),
        1,
        aten.slice_scatter.default,
        Seq(1),
    ),
    "einsum permute": (
        lambda x: torch.einsum("bsc->bcs", x),
        (x3(2, S, 4),),
        1,
        aten.einsum.default,
        Seq(2),
    ),
    "einsum with a weight": (
        lambda x: torch.einsum("...sc,cd->...sd", x, W),
        (x3(2, S, 4),),
        1,
        aten.einsum.default,
        Seq(1),
    ),
    "einsum over the sequence": (
        lambda x: torch.einsum("bsc,bsd->bcd", x, x),
        (x3(2, S, 4),),
        1,
        aten.einsum.default,
        GatherReason.PRODUCT,
    ),
    "einsum with a replicated sequence": (
        lambda x, p: torch.einsum("bsc,sc->bsc", x, p),
        (x3(2, S, 4), x3(S, 4)),
        1,
        aten.einsum.default,
        GatherReason.MISALIGNED,
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
    "index of a few positions": (  # taken from their ranks: replicated
        lambda x: x[:, torch.tensor([0, 2])],
        (x3(2, S, 4),),
        1,
        aten.index.Tensor,
        None,
    ),
    "index along the sequence": (
        lambda x: x[:, torch.arange(S).flip(0)],
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
        lambda x: x.gather(-1, torch.arange(2 * S).view(2, S, 1) % 4),
        (x3(2, S, 4),),
        1,
        aten.gather.default,
        Seq(1),
    ),
    "gather by a fresh index": (
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
    check_inferred(CASES, case)


@pytest.mark.parametrize(
    ("geometry", "columns", "want"),
    [
        (SequenceGeometry(S, S, 2, "contiguous"), 4, Seq(1, 1, 4)),  # chunks of 4: one row each
        (SequenceGeometry(S - 4, S, 2, "contiguous"), 2, Seq(1, 1, 2)),  # 4 positions padded to 8
        (SequenceGeometry(S, S, 2, "zigzag"), 2, Seq(1, 1, 2)),  # 2 chunks of one row per rank
        (SequenceGeometry(S, S, 2, "zigzag"), 4, "chunks of 2"),  # chunks cut the rows
        (SequenceGeometry(S, S, 2, "contiguous", general=True), 4, "chunks of 4"),  # any length
    ],
)
def test_a_view_into_a_grid_keeps_whole_rows(geometry, columns, want):
    """An unpatchify's (B, S, C) -> (B, rows, columns, C): sharded along the rows where every
    chunk of the layout is whole rows; else gathered, the report naming the rows and chunks."""
    rows = geometry.length // columns
    got = view_placement([2, geometry.length, 3], Seq(1), [2, rows, columns, 3], geometry)
    if isinstance(want, Seq):
        assert got == want
    else:
        assert got.reason is GatherReason.VIEW_SPLITS and want in got.detail, got
    # a grid's rows follow into a later view that keeps them whole (row, column pairs)
    if isinstance(want, Seq):
        assert view_placement([2, rows, columns, 3], got, [2, rows, columns * 3], geometry) == got


def test_a_replicated_operand_that_lines_up_is_a_meeting():
    """The meetings are how labels and positions are found: here p (S, 4) against x's sequence."""
    graph, _, _, inference = infer(lambda x, p: x + p, (x3(2, S, 4), x3(S, 4)), 1)
    p = [n for n in graph.nodes if n.op == "placeholder"][1]
    assert (p, Seq(0)) in inference.place.meetings


def test_weights_go_through_copy_to_ring():
    graph, _targets = targets_after(CASES, "linear")
    linear = node_of(graph, aten.linear.default)
    assert linear.args[1].target is copy_to_ring


def test_broadcast_operand_that_lines_up_is_sliced():
    graph, _ = targets_after(CASES, "broadcast")
    operand = node_of(graph, aten.add.Tensor).args[1]
    assert operand.target is aten.reshape.default  # of take_shard's output
    assert operand.args[0].target is ringify_ops.take_shard.default


@pytest.mark.parametrize(
    ("case", "local"),
    [("view keeps the sequence", [2, S // 2, 2, 2]), ("view merges batch and sequence", [S, 4])],
)
def test_views_get_local_sizes(case, local):
    graph, _ = targets_after(CASES, case)
    (view,) = [n for n in graph.nodes if n.target is aten.reshape.default]
    assert view.args[1] == local


@pytest.mark.parametrize(
    ("case", "op"), [("expand", aten.expand.default), ("broadcast_to", aten.broadcast_to.default)]
)
def test_expand_gets_local_size(case, op):
    graph, _ = targets_after(CASES, case)
    assert node_of(graph, op).args[1] == [2, S // 2, 5]


def test_gather_slices_a_replicated_index_that_lines_up():
    graph, _ = targets_after(CASES, "gather")
    index = node_of(graph, aten.gather.default).args[2]
    assert index.target is aten.reshape.default  # of take_shard's output
    assert index.args[0].target is ringify_ops.take_shard.default


def test_a_fresh_tensor_that_lines_up_is_made_at_a_ranks_size():
    """A ``zeros`` that meets the sequence (an MoE's base to add rows into) is never made
    whole: the factory makes this rank's part."""
    graph, _ = targets_after(CASES, "gather by a fresh index")
    index = node_of(graph, aten.gather.default).args[2]
    assert index.target is aten.zeros.default and index.args[0] == [2, S // 2, 1]


def test_a_fallback_gathers_its_sharded_inputs():
    graph, _targets = targets_after(CASES, "no rule")
    cummax = node_of(graph, aten.cummax.default)
    assert cummax.args[0].target is ringify_ops.gather.default  # the sequence a dim of its own


def test_state_crossings_are_inserted_once():
    graph, geometry, _x, inference = infer(lambda x, p: x + p, (x3(2, S, 4), x3(S, 4)), 1)
    state = PassState(graph, geometry, "", dict(inference.place.of))
    p = [n for n in graph.nodes if n.op == "placeholder"][1]
    assert state.slice(p, Seq(0), 0) is state.slice(p, Seq(0), 0)
    assert state.copy_to_ring(p) is state.copy_to_ring(p)
    assert state.place[state.slice(p, Seq(0), 0)] == Seq(0)


def test_a_rule_that_raises_is_ringifys_defect(monkeypatch):
    """A rule that raises is a bug in ringify, not a property of the model: the suite (strict
    mode, set in conftest) fails on it; a user's pass gathers the op (exact) and reports it
    as ringify's defect, naming the op and the error."""

    def broken(node, place):
        raise KeyError("a slip in the rule")

    monkeypatch.setitem(rules.RULES, aten.exp.default, Rule(broken, as_it_is))
    fn, inputs = (lambda x: x.exp() + 1), (x3(2, S, 4),)
    with pytest.raises(RuntimeError) as raised:
        infer(fn, inputs, 1)
    assert isinstance(raised.value.__cause__, KeyError)
    monkeypatch.setenv(STRICT, "0")
    graph, _, _, inference = infer(fn, inputs, 1)
    decided = inference.decisions[node_of(graph, aten.exp.default)]
    assert isinstance(decided, Fallback) and decided.reason is GatherReason.RULE_FAILED
    assert "aten.exp.default" in decided.detail and "KeyError" in decided.detail
