"""Module regions of a flat graph outlined, and per-layer FSDP2 kept around its units' regions.

``torch.export`` flattens module boundaries but tags every node with the modules whose
call made it (``meta["nn_module_stack"]``). A region is the contiguous span from a
module's first node to its last, with whatever the pass inserted in between (the ring
op, slices, copies to the ring): a span of a topologically ordered graph can always be
outlined into a submodule that the graph calls in its place, and what a module's call
carries at run time (a checkpoint, ``checkpoints.py``; an FSDP2 unit's hooks) then wraps
exactly that span.

The trace saw each FSDP2 unit's parameters at full shape (``stacks/fsdp_units.py``), and
``lift_state`` made them graph inputs like every parameter. Here each unit's span
(``module_span``, innermost unit first) is outlined into an ``FsdpUnitRegion``, together
with what the pass computed from the unit's parameters alone (their ``copy_to_ring``,
slices), which it had placed at the top of the graph. The region reads those parameters
from the unit after FSDP all-gathers them, so they stop being inputs of the graph:
``keep_fsdp_units`` returns the state names left (the model's own unit, if it is one:
the whole graph).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

from torch import fx, nn

from ringify.runtime.collectives.reduce import copy_averaged_outside, copy_to_ring
from ringify.runtime.region_runs import FsdpUnitRegion
from ringify.stacks.fsdp_units import unit_groups, unit_parameters


def keep_fsdp_units(
    gm: fx.GraphModule,
    model: nn.Module,
    units: dict[str, nn.Module],
    state_names: tuple[str, ...],
    reduced_outside: dict[str, int],
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Outline each FSDP unit's span; (the state names still read at the top of the graph,
    the units kept, by name). The weights of the units in ``reduced_outside`` (``""``: the
    root unit around the ringified model) skip the ring's own gradient reduction, their
    partial gradients scaled as it says (``units_reducing_over_ring``)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    read = dict(zip(state_names, placeholders, strict=False))
    owned = unit_parameters(model, units, state_names)
    for unit, scale in reduced_outside.items():
        for name in owned[unit]:
            for user in [u for u in read[name].users if u.target is copy_to_ring]:
                user.target, user.args = copy_averaged_outside, (read[name], scale)
    if not units:
        return state_names, ()
    kept = set()
    groups = unit_groups(units)
    # inner units first: a unit's span holds the calls of the units inside it
    for index, unit in enumerate(sorted(groups, key=lambda u: _depth(groups[u]))):
        paths = groups[unit]
        params = {read[name]: name for name in owned[unit]}
        span = _whole(gm.graph) if paths == ("",) else module_span(gm.graph, paths)
        if not span:
            continue  # the unit did not run in this call
        span = _with_parameter_work(span, params, unit)

        def wrap(region, inputs, modules=tuple(units[p] for p in paths), params=params):
            at = {i: params[node] for i, node in enumerate(inputs) if node in params}
            return FsdpUnitRegion(region, modules, model, at)

        call = outline(gm, span, f"fsdp_unit_{index}", wrap)
        call.args = tuple(a for a in call.args if a not in params)
        for node in params:
            gm.graph.erase_node(node)
        kept.add(unit)
    gm.delete_all_unused_submodules()
    gm.graph.lint()
    lifted = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    left = tuple(name for name in state_names if read[name].name in lifted)
    return left, tuple(unit for unit in groups if unit in kept)


def _depth(paths: tuple[str, ...]) -> tuple[bool, int]:
    """A unit's place in the order of outlining: the model's own last, then the shallower."""
    return paths == ("",), -min(p.count(".") for p in paths)


def _whole(graph: fx.Graph) -> list[fx.Node]:
    """The span of the model itself: every node after the last input but the output."""
    nodes = list(graph.nodes)
    last = max(i for i, n in enumerate(nodes) if n.op == "placeholder")
    return [n for n in nodes[last + 1 :] if n.op != "output"]


def _with_parameter_work(span: list[fx.Node], params: dict[fx.Node, str], unit: str):
    """``span`` with, moved to its start, the nodes computed from the unit's parameters
    alone; raise if a parameter is used outside the unit's forward."""
    inside = set(span)
    work: list[fx.Node] = []
    frontier = list(params)
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in inside or user in work:
                continue
            if user.op != "output" and all(a in params or a in work for a in user.all_input_nodes):
                work.append(user)
                frontier.append(user)
                continue
            raise ValueError(
                f"the parameter {params.get(node, node.name)} of the FSDP2 unit {unit} "
                "is used outside that unit's forward, where FSDP has resharded it. Use each "
                "parameter only inside the forward of the unit that owns it (tied weights: "
                "keep them in one unit, e.g. the root)."
            )
    order = {n: i for i, n in enumerate(span[0].graph.nodes)}
    work.sort(key=order.__getitem__)
    for node in work:
        span[0].prepend(node)
    return work + span


def in_module(node: fx.Node, path: str) -> bool:
    """Whether ``node`` was made inside the call of the module at ``path``."""
    return any(p == path for p, _ in (node.meta.get("nn_module_stack") or {}).values())


def module_span(graph: fx.Graph, paths: tuple[str, ...]) -> list[fx.Node]:
    """The nodes from the first made inside the call of one of the modules at ``paths`` to
    the last, in graph order."""
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    inside = [i for i, n in enumerate(nodes) if any(in_module(n, p) for p in paths)]
    return nodes[inside[0] : inside[-1] + 1] if inside else []


def outline(
    gm: fx.GraphModule,
    span: list[fx.Node],
    name: str,
    wrap: Callable[[fx.GraphModule, list[fx.Node]], nn.Module],
) -> fx.Node:
    """Move ``span`` into submodule ``name`` (``wrap`` of its graph module and the nodes it
    takes) and call it in its place; the call node. The submodule takes the values the span
    reads from before it and returns, as a tuple, those read after it. The call counts as
    made inside every module all of the span's nodes were made in, so that an enclosing
    module's span still covers it."""
    inside = set(span)
    inputs: dict[fx.Node, None] = {}
    for node in span:
        for arg in node.all_input_nodes:
            if arg not in inside:
                inputs.setdefault(arg)
    outputs = [n for n in span if any(u not in inside for u in n.users)]
    graph, env = fx.Graph(), {}
    for arg in inputs:
        env[arg] = graph.placeholder(arg.name)
        env[arg].meta = dict(arg.meta)
    for node in span:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in outputs))
    gm.add_submodule(name, wrap(fx.GraphModule(gm, graph, class_name=name), list(inputs)))
    with gm.graph.inserting_before(span[0]):
        call = gm.graph.call_module(name, tuple(inputs))
        call.meta["val"] = tuple(n.meta.get("val") for n in outputs)
        call.meta["nn_module_stack"] = _common_stack(span)
        for i, node in enumerate(outputs):
            got = gm.graph.call_function(operator.getitem, (call, i))
            got.meta = dict(node.meta)
            node.replace_all_uses_with(got, delete_user_cb=lambda user: user not in inside)
    for node in reversed(span):
        gm.graph.erase_node(node)
    return call


def _common_stack(span: list[fx.Node]) -> dict:
    """The ``nn_module_stack`` entries every node of ``span`` that has one shares."""
    stacks = [n.meta["nn_module_stack"] for n in span if n.meta.get("nn_module_stack")]
    if not stacks:
        return {}
    return {k: v for k, v in stacks[0].items() if all(s.get(k) == v for s in stacks[1:])}
