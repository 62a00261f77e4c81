"""Per-layer FSDP2 kept: each unit's span of the rewritten graph runs inside its FSDP hooks
(the model's own unit, if it is one: the whole graph).

The trace saw each unit's parameters at full shape (``parallelized.py``), and
``lift_state`` made them graph inputs like every parameter. Here each unit's span
(``regions.module_span``, innermost unit first) is outlined into an
``FsdpUnitRegion``, together with what the pass computed from the unit's parameters
alone (their ``copy_to_ring``, slices), which it had placed at the top of the graph.
The region reads those parameters from the unit after FSDP all-gathers them, so they
stop being inputs of the graph: ``keep_fsdp_units`` returns the state names left.
"""

from __future__ import annotations

from torch import fx, nn

from ringify.parallelized import unit_parameters
from ringify.passes.regions import module_span, outline
from ringify.runtime.collectives.reduce import copy_averaged_outside, copy_to_ring
from ringify.runtime.fsdp_unit import FsdpUnitRegion


def keep_fsdp_units(
    gm: fx.GraphModule,
    model: nn.Module,
    units: dict[str, nn.Module],
    state_names: tuple[str, ...],
    averaged: frozenset[str],
    ring_size: int,
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Outline each FSDP unit's span; (the state names still read at the top of the graph,
    the units kept). The weights of the units in ``averaged`` (``""``: the root unit
    around the ringified model) skip the ring's own gradient reduction."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    read = dict(zip(state_names, placeholders, strict=False))
    owned = unit_parameters(model, units, state_names)
    for path in averaged:
        for name in owned[path]:
            for user in [u for u in read[name].users if u.target is copy_to_ring]:
                user.target, user.args = copy_averaged_outside, (read[name], ring_size)
    if not units:
        return state_names, ()
    kept = set()
    for index, path in enumerate(sorted(units, key=lambda p: (p == "", -p.count(".")))):
        params = {read[name]: name.removeprefix(path + ".") for name in owned[path]}
        span = _whole(gm.graph) if path == "" else module_span(gm.graph, path)
        if not span:
            continue  # the unit did not run in this call
        span = _with_parameter_work(span, params, path)

        def wrap(region, inputs, unit=units[path], params=params):
            at = {i: params[node] for i, node in enumerate(inputs) if node in params}
            return FsdpUnitRegion(region, unit, at)

        call = outline(gm, span, f"fsdp_unit_{index}", wrap)
        call.args = tuple(a for a in call.args if a not in params)
        for node in params:
            gm.graph.erase_node(node)
        kept.add(path)
    gm.delete_all_unused_submodules()
    gm.graph.lint()
    lifted = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    left = tuple(name for name in state_names if read[name].name in lifted)
    return left, tuple(path for path in units if path in kept)


def _whole(graph: fx.Graph) -> list[fx.Node]:
    """The span of the model itself: every node after the last input but the output."""
    nodes = list(graph.nodes)
    last = max(i for i, n in enumerate(nodes) if n.op == "placeholder")
    return [n for n in nodes[last + 1 :] if n.op != "output"]


def _with_parameter_work(span: list[fx.Node], params: dict[fx.Node, str], path: str):
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
                f"the parameter {path}.{params.get(node, node.name)} of the FSDP2 unit {path} "
                "is used outside that unit's forward, where FSDP has resharded it. Use each "
                "parameter only inside the forward of the unit that owns it (tied weights: "
                "keep them in one unit, e.g. the root)."
            )
    order = {n: i for i, n in enumerate(span[0].graph.nodes)}
    work.sort(key=order.__getitem__)
    for node in work:
        span[0].prepend(node)
    return work + span
