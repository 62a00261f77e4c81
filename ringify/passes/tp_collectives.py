"""Tensor parallelism's collectives written into the traced graph, where each TP layer reads
its weight.

The trace saw one TP rank's local model (``ringify/stacks/tp_layers.py``): every TP weight
its local shard, no collective. Here each layer's matmul or lookup gets what its
placements imply (``runtime/collectives/tp_ops.py``), as the style's hooks would
have done around the module, and as Megatron's layers do:

- column-parallel: ``linear(tp_copy(x), W, b)``, then ``tp_gather`` where the output is
  kept whole;
- row-parallel: ``tp_reduce(linear(x, W)) + b`` (the bias once, after the sum), with
  ``tp_split(x)`` first where the input comes whole;
- a vocabulary split by rows: ``tp_reduce(tp_vocab_embedding(W, ids))``;
- an embedding split by columns: ``embedding(W, ids)``, then ``tp_gather`` where kept whole;
- a whole parameter acting on this rank's heads alone (Qwen3's q_norm): ``tp_copy(p)``.

It runs before the ring's pass, which passes these ops through: each acts on the last dim.
"""

from __future__ import annotations

import torch
from torch import fx

from ringify.passes.graph.nodes import call, evaluate, val
from ringify.passes.graph.report import TpCollective
from ringify.runtime.collectives.ring import ring_by_name
from ringify.runtime.collectives.tp_ops import (
    TP_COPY,
    TP_GATHER,
    TP_REDUCE,
    TP_SPLIT,
    TP_VOCAB_EMBEDDING,
)
from ringify.stacks.tp_layers import TpLayer

aten = torch.ops.aten


def place_tp_collectives(gm: fx.GraphModule, layers: dict[str, TpLayer]) -> None:
    """Rewrite each TP layer's use of its weight in ``gm`` (a graph from ``torch.export``)."""
    if not layers:
        return
    reads: dict[str, list[fx.Node]] = {}  # parameter name -> the nodes that read it
    for node in (n for n in gm.graph.nodes if n.op == "get_attr"):
        reads.setdefault(node.target, []).append(node)
    copies: dict[fx.Node, fx.Node] = {}  # one tp_copy per input, however many layers read it
    for path, layer in layers.items():
        if layer.kind == "titan":  # its collectives were traced (``stacks/titan_plans.py``)
            continue
        if layer.kind == "replicated":
            _partial_gradients(gm.graph, reads, path, layer)
            continue
        weights = reads.get(f"{path}.weight", [])
        if not weights:
            continue  # the layer did not run in this call
        users = [u for w in weights for u in w.users]
        embedding = layer.kind in ("vocab", "embedding_colwise")
        op = aten.embedding.default if embedding else aten.linear.default
        if len(users) != 1 or users[0].target is not op:
            raise ValueError(
                f"{path}.weight is a TP shard read by {[u.name for u in users]}, not by one "
                f"{op}: ringify writes TP's collectives around the layer's own matmul or "
                "lookup. Use the weight only in its module's forward (an lm_head tied to a "
                "split embedding: untie them, or leave both unsplit)."
            )
        _rewrite(gm.graph, users[0], path, layer, copies)
    gm.graph.lint()
    gm.recompile()


def reported_collectives(gm: fx.GraphModule) -> tuple[TpCollective, ...]:
    """The TP collectives of a rewritten graph (and of the regions outlined from it), with
    the bytes each rank sends per step."""
    rows = []
    graphs = [m.graph for m in gm.modules() if isinstance(m, fx.GraphModule)]
    for node in (n for graph in graphs for n in graph.nodes):
        if node.target not in _COLLECTIVES:
            continue
        forward, backward, tensor = _COLLECTIVES[node.target]
        value = val(node.args[0] if tensor == "input" else node)
        size = ring_by_name(node.args[-1]).size
        # a ring all-reduce sends 2 (t - 1) / t of the tensor; an all-gather (t - 1) / t
        share = 2 if "all-reduce" in (forward, backward) else 1
        sent = share * (size - 1) * value.numel() * value.element_size() // size
        layer = node.meta.get("tp_layers") or _module_of(node)
        rows.append(TpCollective(node.name, layer, forward, backward, sent))
    return tuple(rows)


# op -> (forward collective, backward collective, the tensor it moves)
_COLLECTIVES = {
    TP_COPY: ("", "all-reduce", "input"),
    TP_REDUCE: ("all-reduce", "", "input"),
    TP_GATHER: ("all-gather", "", "output"),
    TP_SPLIT: ("", "all-gather", "input"),
}


def _rewrite(
    graph: fx.Graph, node: fx.Node, path: str, layer: TpLayer, copies: dict[fx.Node, fx.Node]
) -> None:
    group = layer.group_name
    if not layer.local_outside:
        _made_local(node, layer)
    if layer.kind == "vocab":
        weight, ids = node.args[:2]
        with graph.inserting_after(node):
            lookup = call(
                graph, TP_VOCAB_EMBEDDING, (weight, ids, layer.vocab, layer.padding_idx, group)
            )
        node.replace_all_uses_with(lookup)
        graph.erase_node(node)
        _after(graph, lookup, TP_REDUCE, path, group, None)
        return
    if layer.kind == "colwise":
        x = node.args[0]
        if x not in copies:
            with graph.inserting_after(_last_input(graph) if x.op == "placeholder" else x):
                copies[x] = call(graph, TP_COPY, (x, group))
            copies[x].meta["tp_layers"] = path
        else:
            copies[x].meta["tp_layers"] += f", {path}"
        node.update_arg(0, copies[x])
    bias = None
    if layer.kind == "rowwise":
        if layer.split_input:
            with graph.inserting_before(node):
                node.update_arg(0, call(graph, TP_SPLIT, (node.args[0], group)))
                node.args[0].meta["tp_layers"] = path
        if len(node.args) > 2 and node.args[2] is not None:
            bias, node.args = node.args[2], node.args[:2]
    node.meta["val"] = evaluate(node)
    if layer.kind == "rowwise":
        _after(graph, node, TP_REDUCE, path, group, bias)
    elif layer.gather_output:
        _after(graph, node, TP_GATHER, path, group, None)


def _partial_gradients(graph: fx.Graph, reads: dict, path: str, layer: TpLayer) -> None:
    """A whole parameter that acts on this rank's heads alone: each read of it goes through
    ``tp_copy``, whose backward sums the TP ranks' partial gradients."""
    own = [n for name, nodes in reads.items() if name.rpartition(".")[0] == path for n in nodes]
    for param in own:
        users = list(param.users)
        with graph.inserting_after(param):
            copy = call(graph, TP_COPY, (param, layer.group_name))
        copy.meta["tp_layers"] = path
        for user in users:
            user.replace_input_with(param, copy)


def _module_of(node: fx.Node) -> str:
    """The path of the innermost module whose call made ``node`` (a TP op a torchtitan
    module's redistribution traced)."""
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


def _last_input(graph: fx.Graph) -> fx.Node:
    return [n for n in graph.nodes if n.op == "placeholder"][-1]


def _made_local(node: fx.Node, layer: TpLayer) -> None:
    """The layer was traced whole: its parameters' values become their local shards'."""
    for param in (a for a in node.all_input_nodes if a.op == "get_attr"):
        whole = param.meta["val"]
        name = param.target.rpartition(".")[2]
        param.meta["val"] = whole.new_empty(layer.local_shape(name, whole.shape))


def _after(graph: fx.Graph, node: fx.Node, op, path: str, group: str, bias: fx.Node | None) -> None:
    """Every user of ``node`` reads ``op(node)`` (plus ``bias``) instead."""
    users = list(node.users)
    with graph.inserting_after(node):
        out = call(graph, op, (node, group))
    out.meta["tp_layers"] = path
    if bias is not None:
        with graph.inserting_after(out):
            out = call(graph, aten.add.Tensor, (out, bias))
    for user in users:
        user.replace_input_with(node, out)
