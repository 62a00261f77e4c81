"""Regions that need the whole sequence but keep another dim independent: run on a share of it.

A node no rule can shard (an SSM's chunked scan, a recurrence) has its inputs gathered, and
it and everything computed from it alone run whole on every rank: memory O(S) per rank.
Where that region never mixes along another dim (heads, channels, the batch), one
all-to-all per input moves it from the sequence onto that dim instead
(``ringify::to_dim``), the region runs on every position of this rank's 1/P of it, and one
all-to-all per output moves it back where a sharded op reads it (``ringify::from_dim``):
DeepSpeed-Ulysses' exchange, found by the pass, with memory O(S/P).

Which dims an op keeps independent is DTensor's knowledge (``shares.py``). A region is
resharded only if no op asks for a collective; an input no op asks to shard stays gathered,
and a whole operand read by a share's computation is copied to the ring (its gradient is
partial). Views and expands take local sizes on the sharded dim only, so a ``-1`` stays
generic. Each input's dims are tried where they divide by the ring; the plan that gathers
fewest bytes wins. Where an op needs the dim whole (a norm over heads merged with the
positions), the region is cut before it, its values go back to the sequence, and the graph
is inferred again from them.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from ringify.passes.graph.crossings import PassState
from ringify.passes.graph.nodes import is_tensor, shape, val
from ringify.passes.graph.placement import Fallback, Seq, SequenceGeometry
from ringify.passes.graph.report import ReshardedRegion, strict
from ringify.passes.graph.vocabulary import ASSERTS, SHAPED
from ringify.passes.sharding.positions import FREE, positions_held, whole_sequence
from ringify.passes.sharding.rules import infer_placements
from ringify.passes.sharding.shares import Resharded, mesh_of, nbytes, propagated
from ringify.runtime.collectives.ring import ring_by_name

aten = torch.ops.aten


def regions(graph: fx.Graph, decisions: dict, ends=frozenset()) -> list[list[fx.Node]]:
    """The gathered regions of an inferred graph: each a fallback node with everything
    computed whole from it, joined where they meet, in graph order. ``ends``: members whose
    values leave their region whole (a cut's values free of the sequence), so that what is
    computed from them is no longer part of it."""
    owner: dict[fx.Node, int] = {}
    parent: list[int] = []

    def find(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for node in graph.nodes:
        if node.op != "call_function":
            continue
        whole_from = {find(owner[a]) for a in node.all_input_nodes if a in owner and a not in ends}
        if isinstance(decisions.get(node), Fallback):
            parent.append(len(parent))
            whole_from.add(parent[-1])
        elif node in decisions or not whole_from:
            continue  # a sharded op (it reads a region's value as a slice), or not reached
        root = min(whole_from)
        for r in whole_from:
            parent[r] = root
        owner[node] = root
    found: dict[int, list[fx.Node]] = {}
    for node, i in owner.items():
        found.setdefault(find(i), []).append(node)
    return list(found.values())


def plan_region(
    nodes: list[fx.Node], place: dict, geo: SequenceGeometry, group_name: str, cut: bool = True
) -> Resharded | Cut | str:
    """The region's plan that gathers fewest bytes, or why it stays gathered. From each dim
    of its first input, the others' dims are chosen one input at a time (each input's dims
    tried from the last to the first: heads before the batch; an input none of whose dims
    serves enters whole). ``cut``: where none serves, the region cut before the op the best
    attempt reached (``Cut``)."""
    members = set(nodes)
    inputs = [a for a in _inputs(nodes, members) if isinstance(place.get(a), Seq)]
    if not inputs:
        return "none of its inputs is sharded along the sequence alone"
    if not all(geo.alone(shape(a)[place[a].dim], place[a]) for a in inputs):
        return "an input's sequence dim holds other dims too"
    mesh = mesh_of(group_name, val(inputs[0]).device.type)

    def dims(a: fx.Node) -> list[int]:
        sizes = shape(a)
        return [
            d
            for d in reversed(range(len(sizes)))
            if d != place[a].dim and sizes[d] % geo.ring_size == 0
        ]

    best, failed = None, []
    for first in [*dims(inputs[0]), None]:  # None: the first enters whole
        seeds = {inputs[0]: first} if first is not None else {}
        plan = propagated(nodes, members, inputs, seeds, mesh, failed)
        for a in inputs[1:]:
            if plan is None or plan.inputs[a] is not None:
                continue
            for d in dims(a):
                trial = propagated(nodes, members, inputs, seeds | {a: d}, mesh, failed)
                if trial is not None and trial.gathered_bytes() < plan.gathered_bytes():
                    plan, seeds[a] = trial, d
                    break
        if plan is not None and (best is None or plan.gathered_bytes() < best.gathered_bytes()):
            best = plan
    if best is not None and best.gathered_bytes() < sum(map(nbytes, inputs)):
        return best
    if not failed:
        return "no dim of its inputs divides by the ring"
    stops = sorted(set(failed), key=nodes.index, reverse=True)  # the furthest reached first
    why = f"no dim it keeps independent divides by the ring: {stops[0].name} ({stops[0].target}) needs it whole"
    for stop in stops if cut else ():
        found = _cut(nodes, stop, place, geo, group_name, why)
        if isinstance(found, Cut):
            return found
    return why


def _inputs(nodes: list[fx.Node], members: set) -> list[fx.Node]:
    seen: dict[fx.Node, None] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in members and is_tensor(a):
                seen[a] = None
    return list(seen)


MAX_CUTS = 3  # inferences again after cutting regions (each cut ends one region early)


def reshard_plans(graph: fx.Graph, geo: SequenceGeometry, seeds: dict, group_name: str):
    """``(inference, plans, why)``: the placements, every gathered region's plan where one
    moves bytes off the gather (by member node), and for the members of the others why they
    stay gathered. A region whose op needs its dim whole (a norm over heads merged with the
    positions) is cut there where it can be: the values that op reads go back to the
    sequence, and the graph is inferred again from them."""
    if ring_by_name(group_name).group is None:  # no ring to ask DTensor (a pass alone)
        return infer_placements(graph, geo, seeds), {}, {}
    cuts: dict[fx.Node, Seq] = {}
    first = None
    for _ in range(MAX_CUTS + 1):
        inference = infer_placements(graph, geo, seeds | cuts)
        plans: dict[fx.Node, Resharded] = {}
        why: dict[fx.Node, str] = {}
        more: dict[fx.Node, Seq] = {}
        ends = {c for c, seq in cuts.items() if seq is None}
        for nodes in regions(graph, inference.decisions, ends):
            try:
                plan = plan_region(nodes, inference.place.of, geo, group_name)
            except Exception as error:  # a question DTensor cannot answer: the gather is exact
                if strict():
                    raise
                plan = f"its plan failed ({type(error).__name__}: {error})"
            if isinstance(plan, Cut):
                more |= plan.exits
                plan = plan.why
            (plans if isinstance(plan, Resharded) else why).update(dict.fromkeys(nodes, plan))
        first = first or (inference, plans, why)
        if not more:
            break
        cuts |= more
    if any(c not in plans for c in cuts):  # a cut whose region no longer plans: none at all
        return first
    return inference, plans, why


@dataclass(frozen=True)
class Cut:
    """A region to end before the op that needs its dim whole: its values that later ops read,
    each with its sequence dim, go back to the sequence."""

    exits: dict
    why: str


def _cut(
    nodes: list[fx.Node], failed: fx.Node, place, geo: SequenceGeometry, group_name: str, why: str
):
    """The cut of a region before ``failed``, or ``why`` where its first part plans nothing
    or a value it hands on is neither the whole sequence on a dim the graph gives it nor free
    of the sequence (an exit free of it is handed on whole: ``None``)."""
    head = nodes[: nodes.index(failed)]
    if not head or not isinstance(plan_region(head, place, geo, group_name, cut=False), Resharded):
        return why
    inside = set(head)
    held = positions_held(head, place)
    exits = {}
    for m in head:
        if any(u not in inside for u in m.users) and is_tensor(m):
            ats = held.get(m)
            if ats == FREE:
                exits[m] = None
            elif ats and len(ats) == 1 and whole_sequence(*ats, shape(m), geo.length):
                exits[m] = Seq(next(iter(ats)).dim)
            else:
                return why
    return Cut(exits, why)


def rewrite_member(node: fx.Node, plan: Resharded, state: PassState) -> None:
    """``node`` on this rank's share: its inputs moved onto their dims (or gathered), whole
    operands it reads as a share sliced, its shape arguments local. A value the ops after a
    cut read goes back to the sequence (``from_dim``); any other value read outside is
    gathered on its dim, which the crossing into the sequence replaces by ``from_dim`` too
    (``PassState.slice``), and which stays where a whole value is read."""
    if node.target in ASSERTS:
        state.graph.erase_node(node)
        return
    if node is plan.nodes[0]:
        state.resharded.append(_reported(plan, state))
    shares = plan.shares.get(node, {})
    d = plan.dims[node]
    partial = node.target is not operator.getitem and _on_a_share(d)

    def operand(a):
        if not isinstance(a, fx.Node) or not is_tensor(a):
            return a
        if a in shares:
            return state.share(_entered(a, plan, state), shares[a])
        value = _entered(a, plan, state)
        read_as = plan.dims[a] if a in plan.dims else plan.inputs.get(a)
        if partial and not _on_a_share(read_as) and val(a).is_floating_point():
            # read whole by a share's computation: this rank's gradient is partial
            return state.copy_to_ring(value)
        return value

    node.args, node.kwargs = fx.node.map_aggregate((node.args, node.kwargs), operand)
    if node.target in SHAPED and isinstance(d, int):
        node.args = _local_sizes(node.args, 1, d, state.geo.ring_size)
    if node.target is aten.unflatten.int and isinstance(d, int):  # (x, dim, sizes)
        dim = node.args[1] % len(shape(node.args[0]))
        if dim <= d < dim + len(node.args[2]):
            node.args = _local_sizes(node.args, 2, d - dim, state.geo.ring_size)
    outside = [u for u in node.users if u not in plan.dims]
    seq = state.place.get(node)
    if outside and isinstance(seq, Seq):  # a cut: back to the sequence for the ops after it
        state.place[node] = None
        local = state.from_dim(node, d, seq) if isinstance(d, int) else state.slice(node, seq, 0)
        for u in outside:
            u.replace_input_with(node, local)
    elif outside and isinstance(d, int):
        whole = state.gather_dim(node, d)
        for u in outside:
            u.replace_input_with(node, whole)


def _local_sizes(args: tuple, at: int, d: int, ring_size: int) -> tuple:
    """``args`` with the size at ``d`` of the sizes ``args[at]`` made this rank's share of it
    (a ``-1`` stays: it follows)."""
    sizes = list(args[at])
    if sizes[d] != -1:
        sizes[d] //= ring_size
    return (*args[:at], sizes, *args[at + 1 :])


def _entered(a: fx.Node, plan: Resharded, state: PassState) -> fx.Node:
    """What a member reads for ``a``: a member as it is; an input moved onto its dim, or
    gathered; anything else (whole) as it is."""
    if a in plan.inputs:
        d = plan.inputs[a]
        return state.to_dim(a, d) if d is not None else state.gather(a)
    return a


def _on_a_share(dims) -> bool:
    return isinstance(dims, int) or (isinstance(dims, list) and any(d is not None for d in dims))


def _reported(plan: Resharded, state: PassState) -> ReshardedRegion:
    entered = tuple((x.name, d) for x, d in plan.inputs.items() if d is not None)
    whole = tuple(x.name for x, d in plan.inputs.items() if d is None)
    moved = sum(nbytes(x) for x, d in plan.inputs.items() if d is not None)
    return ReshardedRegion(plan.nodes[0].name, len(plan.nodes), entered, whole, moved)
