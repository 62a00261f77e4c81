"""Each rule that talks over the ring on one tiny graph: reductions, extrema, softmax,
scans, shifts and attention; placements and the nodes the rewrite inserts."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from rule_graphs import S, check_inferred, node_of, targets_after, x3

from ringify.passes.graph.placement import Seq
from ringify.passes.graph.report import GatherReason
from ringify.runtime.collectives.neighbours import ring_cumsum, ring_shift, shifted
from ringify.runtime.collectives.reduce import copy_to_ring, reduce_from_ring, ring_amax

aten = torch.ops.aten
ringify_ops = torch.ops.ringify
CASES = {
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
    "label shift (pad, then slice)": (
        lambda y: F.pad(y, (0, 1), value=-100)[..., 1:],
        (x3(2, S),),
        1,
        shifted,
        Seq(1),
    ),
    "start token, then all but the last": (
        lambda y, start: torch.cat([start, y[:, :-1]], 1),
        (x3(2, S, 4), x3(2, 1, 4)),
        1,
        shifted,
        Seq(1),
    ),
    "shift along features": (
        lambda y: F.pad(y, (0, 1))[..., 1:],
        (x3(2, S, 4),),
        1,
        shifted,
        Seq(1),
    ),
    "shift by more than a chunk": (
        lambda y: F.pad(y, (0, 5))[..., 5:],
        (x3(2, S),),
        1,
        shifted,
        GatherReason.ALONG_SEQUENCE,
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
}


@pytest.mark.parametrize("case", list(CASES))
def test_inferred_placement(case):
    check_inferred(CASES, case)


@pytest.mark.parametrize(
    ("case", "count"), [("sum over the sequence", 1), ("mean", 1), ("cross_entropy", 2)]
)
def test_reductions_over_the_sequence_reduce_over_the_ring(case, count):
    _, targets = targets_after(CASES, case)
    assert targets.count(reduce_from_ring) == count  # cross-entropy: loss and target count


def test_attention_becomes_the_ring_op_with_its_fake_value():
    graph, targets = targets_after(CASES, "attention")
    assert aten.scaled_dot_product_attention.default not in targets
    ring = node_of(graph, ringify_ops.ring_attention.default)
    out, lse = ring.meta["val"]
    assert tuple(out.shape) == (1, 2, S, 4) and out.dtype == torch.float64
    assert tuple(lse.shape) == (1, 2, S) and lse.dtype == torch.float64
    (out_node,) = ring.users  # the unused lse is dead code, removed
    assert out_node.target is operator.getitem and out_node.args[1] == 0
    assert out_node.meta["val"].shape == out.shape


@pytest.mark.parametrize("case", ["amax over the sequence", "max of all"])
def test_maxima_over_the_sequence_become_ring_amax(case):
    _, targets = targets_after(CASES, case)
    assert targets.count(ring_amax) == 1 and aten.amax.default not in targets


def test_softmax_along_the_sequence_normalises_over_the_ring():
    _, targets = targets_after(CASES, "softmax along the sequence")
    assert aten.softmax.int not in targets
    assert targets.count(ring_amax) == 1 and targets.count(reduce_from_ring) == 1
    assert targets.count(copy_to_ring) == 1  # the total's gradient is summed over the ring


def test_cumsum_along_the_sequence_becomes_the_ring_scan():
    graph, _ = targets_after(CASES, "cumsum along the sequence")
    (scan,) = [n for n in graph.nodes if n.target is ring_cumsum]
    assert scan.args[1:] == (1, "", "contiguous")


@pytest.mark.parametrize(
    ("case", "shift"),
    [("label shift (pad, then slice)", 1), ("start token, then all but the last", -1)],
)
def test_a_shift_along_the_sequence_is_a_halo_exchange(case, shift):
    graph, targets = targets_after(CASES, case)
    assert aten.slice.Tensor not in targets and aten.cat.default not in targets
    (halo,) = [n for n in graph.nodes if n.target is ring_shift]
    assert halo.args[1:3] == (1, shift) and halo.args[4:6] == (S, S)
    assert ringify_ops.gather.default not in targets


def test_a_shift_along_features_stays_local():
    graph, targets = targets_after(CASES, "shift along features")
    (shift,) = [n for n in graph.nodes if n.target is shifted]
    assert shift.args[1:3] == (2, 1) and ring_shift not in targets
