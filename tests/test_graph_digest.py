"""The canonical graph digest the ranks compare after a trace: blind to the order and names of
independent nodes, not to what the graph computes or to the order of its collectives."""

from __future__ import annotations

import operator

import torch
from torch import fx

from ringify.passes.digest import graph_digest

aten = torch.ops.aten
OPS = {"a": aten.sin.default, "b": aten.cos.default}


def _graph(order=("a", "b"), constant=2.0, reduced=()) -> fx.GraphModule:
    """sin(x) and cos(x), made in ``order``; those in ``reduced`` all-reduced, in that order;
    then (sin + cos) * constant."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    made = {name: graph.call_function(OPS[name], (x,)) for name in order}
    for name in reduced:
        reduce = torch.ops._c10d_functional.all_reduce.default
        made[name] = graph.call_function(reduce, (made[name], "sum", "0"))
    total = graph.call_function(aten.add.Tensor, (made["a"], made["b"]))
    graph.output(graph.call_function(aten.mul.Tensor, (total, constant)))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_independent_nodes_in_another_order_give_one_digest():
    one, other = _graph(order=("a", "b")), _graph(order=("b", "a"))
    assert one.code != other.code  # what the ranks compared before: the text differs
    assert graph_digest(one) == graph_digest(other)


def test_another_constant_op_or_collective_order_changes_the_digest():
    base = graph_digest(_graph(reduced=("a", "b")))
    assert base == graph_digest(_graph(order=("b", "a"), reduced=("a", "b")))
    assert base != graph_digest(_graph(reduced=("a", "b"), constant=3.0))
    assert base != graph_digest(_graph(reduced=("b", "a")))  # collectives in another order
    assert base != graph_digest(_graph(reduced=("a",)))


def test_a_nested_graph_is_read_by_content():
    """A call_module of a nested graph (a checkpointed region) counts by what it computes."""

    def outer(inner: fx.GraphModule) -> fx.GraphModule:
        root = torch.nn.Module()
        root.region = inner
        graph = fx.Graph()
        graph.output(graph.call_module("region", (graph.placeholder("x"),)))
        return fx.GraphModule(root, graph)

    same = graph_digest(outer(_graph(order=("b", "a"))))
    assert graph_digest(outer(_graph())) == same
    assert graph_digest(outer(_graph(constant=3.0))) != same


def _copies(order: tuple[str, str], needs_grad: bool) -> fx.GraphModule:
    """Two inputs copied to the ring (``copy_to_ring``: an all-reduce in the backward only) in
    ``order``; the inputs require a gradient or not (a buffer, a position table)."""
    from ringify.runtime.collectives.reduce import copy_to_ring

    graph = fx.Graph()
    inputs = {}
    for name in ("a", "b"):
        inputs[name] = graph.placeholder(name)
        inputs[name].meta["val"] = torch.empty(3, requires_grad=needs_grad)
    made = {name: graph.call_function(copy_to_ring, (inputs[name], "0")) for name in order}
    graph.output(graph.call_function(aten.add.Tensor, (made["a"], made["b"])))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_copies_to_the_ring_matter_in_order_only_where_a_gradient_reaches_them():
    """Their backward all-reduces follow the forward's order: it matters where a gradient
    flows, and nowhere else (export orders two RoPE tables of Gemma3 by each rank's hash
    seed; the tables need no gradient)."""
    assert graph_digest(_copies(("a", "b"), False)) == graph_digest(_copies(("b", "a"), False))
    assert graph_digest(_copies(("a", "b"), True)) != graph_digest(_copies(("b", "a"), True))


def _plans(order: tuple[str, str]) -> fx.GraphModule:
    """Two mask programs' host copies, plans and step masks, made in ``order`` (HF makes a
    mask per layer type in a set's order: each process's own)."""
    graph = fx.Graph()
    inputs = {"a": graph.placeholder("positions"), "b": graph.placeholder("padding")}
    made = {}
    for name in order:
        host = graph.call_function(torch.ops.ringify.host_inputs.default, ([inputs[name]],))
        copied = graph.call_function(operator.getitem, (host, 0))
        plan = graph.call_function(
            torch.ops.ringify.attention_plan.default, (name, [copied], 8, True, "0", "zigzag", 16)
        )
        masks = ([inputs[name]], plan, torch.float32, False, torch.device("cpu"), 8)
        made[name] = graph.call_function(torch.ops.ringify.step_masks.default, masks)
    graph.output((made["a"], made["b"]))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_a_steps_plans_in_another_order_give_one_digest():
    """Plans and step masks are made on each rank alone: their order is not a difference."""
    assert graph_digest(_plans(("a", "b"))) == graph_digest(_plans(("b", "a")))
