"""Tiny graphs for the rule tests: trace a function, shard its first input, infer, rewrite.

A function is traced with torch.export; its first input is sharded along one dim;
a test reads the placement the rules infer for the node of one op (or the reason
it falls back), then runs the rewrite for a ring of 2 (nothing is executed: the
graph is only read) and checks what the rule inserted.
"""

from __future__ import annotations

import torch
from torch import fx

from ringify.passes.folds.shifts import fold_shifts
from ringify.passes.graph.placement import Fallback, Seq, SequenceGeometry
from ringify.passes.graph.report import GatherReason
from ringify.passes.sharding.rules import infer_placements
from ringify.passes.sharding.sequence_plan import Plan
from ringify.passes.sharding.shard_sequence import shard_sequence

S = 8  # the sequence length of every case


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


def trace(fn, *inputs) -> fx.Graph:
    gm = torch.export.export(_Fn(fn), inputs, strict=False).module()
    fold_shifts(gm)  # as ringify's trace does
    return gm.graph


def node_of(graph: fx.Graph, target) -> fx.Node:
    (node,) = [n for n in graph.nodes if n.target == target]
    return node


def infer(fn, inputs, dim):
    """The graph, and the placements with its first input sharded along ``dim``."""
    graph = trace(fn, *inputs)
    x = next(n for n in graph.nodes if n.op == "placeholder")
    geometry = SequenceGeometry(S, S, 2, "contiguous")
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


def check_inferred(cases: dict, case: str) -> None:
    """The placement (or fallback reason) the rules give the case's op is the one it names."""
    fn, inputs, dim, target, want = cases[case]
    graph, _, _, inference = infer(fn, inputs, dim)
    decided = inference.decisions[node_of(graph, target)]
    if isinstance(want, GatherReason):
        assert isinstance(decided, Fallback) and decided.reason is want, decided
    else:
        assert decided == want


def targets_after(cases: dict, case: str):
    """The case's graph rewritten, and the targets of its call_function nodes."""
    fn, inputs, dim, *_ = cases[case]
    graph, geometry, x, _ = infer(fn, inputs, dim)
    return graph, rewrite(graph, geometry, x, dim)


def x3(*shape):
    return torch.randn(*shape, dtype=torch.float64)
