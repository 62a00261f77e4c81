"""Regions that need the whole sequence but keep another dim independent: run on a share of it.

A node no rule can shard (an SSM's chunked scan, a recurrence) has its inputs gathered, and
it and everything computed from it alone run whole on every rank: memory O(S) per rank.
Where that region never mixes along another dim (heads, channels, the batch), one
all-to-all per input moves it from the sequence onto that dim instead
(``ringify::to_dim``), the region runs on every position of this rank's 1/P of it, and one
all-to-all per output moves it back where a sharded op reads it (``ringify::from_dim``):
DeepSpeed-Ulysses' exchange, found by the pass, with memory O(S/P).

Which dims an op keeps independent is DTensor's knowledge: its sharding propagation is asked
op by op, with the region's inputs ``Shard(dim)`` and everything else ``Replicate``. A region
is resharded only if no op asks for a collective; a replicated operand it asks to be sharded
(a per-head parameter) is sliced locally, and an input it never asks to shard stays
gathered. Shapes the ops take (views, expands) become local as DTensor computes them. Each
input's dim is tried where it divides by the ring; the choice that gathers fewest bytes wins.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema
from torch.utils import _pytree as pytree

from ringify.passes.crossings import PassState
from ringify.passes.nodes import ASSERTS, is_tensor, shape, val
from ringify.passes.placement import Fallback, Geometry, Seq
from ringify.passes.report import ReshardedRegion
from ringify.passes.rules import infer_placements
from ringify.runtime.collectives.ring import ring_by_name

aten = torch.ops.aten


@dataclass
class Resharded:
    """One region's plan: where each of its values lives (a dim of its share, ``None``: whole,
    a list for several outputs), the dim each sequence-sharded input enters on (``None``:
    gathered), and per node the whole operands it reads as this rank's share of a dim."""

    nodes: list[fx.Node]
    inputs: dict[fx.Node, int | None]
    dims: dict[fx.Node, object] = field(default_factory=dict)
    shares: dict[fx.Node, dict[fx.Node, int]] = field(default_factory=dict)
    read: dict[fx.Node, fx.Node] = field(default_factory=dict)  # input -> its first reader

    def gathered_bytes(self) -> int:
        return sum(_nbytes(x) for x, d in self.inputs.items() if d is None)

    def gathers_for(self, node: fx.Node) -> bool:
        """Whether ``node`` is the first to read an input that still enters whole (gathered):
        the gather reported once."""
        return any(self.read.get(a) is node for a, d in self.inputs.items() if d is None)


def regions(graph: fx.Graph, decisions: dict) -> list[list[fx.Node]]:
    """The gathered regions of an inferred graph: each a fallback node with everything
    computed whole from it, joined where they meet, in graph order."""
    owner: dict[fx.Node, int] = {}
    parent: list[int] = []

    def find(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for node in graph.nodes:
        if node.op != "call_function":
            continue
        whole_from = {find(owner[a]) for a in node.all_input_nodes if a in owner}
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
    nodes: list[fx.Node], place: dict, geo: Geometry, group_name: str, cut: bool = True
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
    mesh = _mesh(group_name, val(inputs[0]).device.type)

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
        plan = _propagated(nodes, members, inputs, seeds, mesh, failed)
        for a in inputs[1:]:
            if plan is None or plan.inputs[a] is not None:
                continue
            for d in dims(a):
                trial = _propagated(nodes, members, inputs, seeds | {a: d}, mesh, failed)
                if trial is not None and trial.gathered_bytes() < plan.gathered_bytes():
                    plan, seeds[a] = trial, d
                    break
        if plan is not None and (best is None or plan.gathered_bytes() < best.gathered_bytes()):
            best = plan
    if best is not None and best.gathered_bytes() < sum(map(_nbytes, inputs)):
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


def _propagated(nodes, members, inputs, seeds, mesh, failed: list) -> Resharded | None:
    """The region's plan with ``seeds`` entering on their dims, or None where an op would
    need a collective (or has no sharding strategy; it is added to ``failed``)."""
    plan = Resharded(nodes, {a: seeds.get(a) for a in inputs})
    for node in nodes:
        placed = _node_placed(node, members, plan, mesh)
        if placed is False:
            failed.append(node)
            return None
        plan.dims[node] = placed
        for a in node.all_input_nodes:
            if a in plan.inputs and a not in plan.read:
                plan.read[a] = node
    return plan


def _node_placed(node: fx.Node, members: set, plan: Resharded, mesh: DeviceMesh):
    if node.target is operator.getitem:
        outs = plan.dims[node.args[0]]
        return outs[node.args[1]] if isinstance(outs, list) else outs
    if node.target in ASSERTS:  # erased by the rewrite: it computes nothing
        return None
    if not isinstance(node.target, torch._ops.OpOverload) or _refused(node.target):
        return False

    def spec(a: fx.Node) -> DTensorSpec:
        d = plan.dims[a] if a in members else plan.inputs.get(a)
        return _spec(mesh, val(a), d)

    if node.target is aten.einsum.default:
        equation, operands = node.args
        return _einsum(node, equation, operands, [spec(a) for a in operands], plan)
    if node.target in (aten.tril.default, aten.triu.default):  # no DTensor rule: batch dims
        d = spec(node.args[0]) and _shard_dim(spec(node.args[0]))
        return d if d is None or d < len(shape(node)) - 2 else False
    if node.target is aten.matmul.default:
        equation = _matmul_equation(*(len(shape(a)) for a in node.args[:2]))
        operands = node.args[:2]
        return equation and _einsum(node, equation, operands, [spec(a) for a in operands], plan)
    args, kwargs = fx.node.map_aggregate(
        (node.args, node.kwargs), lambda a: spec(a) if isinstance(a, fx.Node) and is_tensor(a) else a
    )  # fmt: skip
    try:
        out = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding(
            OpSchema(node.target, tuple(args), dict(kwargs))
        )
    except Exception:  # no strategy for the op: the region stays gathered
        return False
    if out.needs_redistribute:
        wanted = out.redistribute_schema
        have = pytree.tree_leaves((args, kwargs), is_leaf=_is_spec)
        want = pytree.tree_leaves((wanted.args_schema, wanted.kwargs_schema), is_leaf=_is_spec)
        for a, h, w in zip(pytree.tree_leaves((node.args, node.kwargs)), have, want, strict=True):
            if not _is_spec(h) or h.placements == w.placements:
                continue
            d = _shard_dim(w)
            if d is None or _shard_dim(h) is not None:
                return False  # a collective inside the region
            _read_as_share(plan, node, a, d)
    return _placed(out.output_spec, mesh.size())


def _matmul_equation(a: int, b: int) -> str | False:
    """``matmul`` of operands of ``a`` and ``b`` dims as an einsum (batch dims aligned from
    the right), or False for a vector operand."""
    if a < 2 or b < 2:
        return False
    batch = "abcdefgh"[: max(a, b) - 2]
    return f"{batch[len(batch) - a + 2 :]}ij,{batch[len(batch) - b + 2 :]}jk->{batch}ik"


def _einsum(node: fx.Node, equation: str, operands, specs: list[DTensorSpec], plan: Resharded):
    """An einsum's output dim (DTensor decomposes it, and matmul, at run time and has no rule
    for either): one label may be sharded, in every operand that has it and in the output (a
    contracted one would be a partial sum); a whole operand with that label is read as a
    share, unless it holds the label at size 1 (a broadcast)."""
    ins, _, out = equation.replace(" ", "").partition("->")
    ins = ins.split(",")
    if "." in equation or not out:
        return False
    labels = {ins[i][d] for i, s in enumerate(specs) if (d := _shard_dim(s)) is not None}
    if len(labels) != 1:
        return None if not labels else False
    (label,) = labels
    if out.count(label) != 1 or any(term.count(label) > 1 for term in ins):
        return False  # contracted (a partial sum), or a diagonal
    for a, spec, labels_in in zip(operands, specs, ins, strict=True):
        at = labels_in.find(label)
        if at >= 0 and _shard_dim(spec) is None and shape(a)[at] != 1:
            _read_as_share(plan, node, a, at)
        elif at >= 0 and _shard_dim(spec) is not None and shape(a)[at] == 1:
            return False
    return out.index(label)


def _read_as_share(plan: Resharded, node: fx.Node, a: fx.Node, d: int) -> None:
    """``node`` reads whole ``a`` as this rank's share of dim ``d``: an input no node has
    read yet enters on ``d``; anything else is sliced there (a local copy)."""
    if plan.inputs.get(a, 0) is None and a not in plan.read:
        plan.inputs[a] = d
    else:
        plan.shares.setdefault(node, {})[a] = d


def _placed(spec, ring_size: int):
    """An output's dim (None: whole), a list for several, or False where it is a partial
    sum or an uneven share."""
    if isinstance(spec, (list, tuple)):
        dims = [_placed(s, ring_size) for s in spec]
        return False if False in dims else dims
    if spec is None:
        return None
    (p,) = spec.placements
    if p.is_partial():
        return False
    d = _shard_dim(spec)
    if d is not None and spec.tensor_meta.shape[d] % ring_size:
        return False
    return d


def _inputs(nodes: list[fx.Node], members: set) -> list[fx.Node]:
    seen: dict[fx.Node, None] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in members and is_tensor(a):
                seen[a] = None
    return list(seen)


def _mesh(group_name: str, device_type: str) -> DeviceMesh:
    return DeviceMesh.from_group(ring_by_name(group_name).group, device_type)


def _spec(mesh: DeviceMesh, value: torch.Tensor, dim: int | None) -> DTensorSpec:
    placement = Replicate() if dim is None else Shard(dim)
    meta = TensorMeta(value.shape, value.stride(), value.dtype)
    return DTensorSpec(mesh, (placement,), tensor_meta=meta)


def _is_spec(x) -> bool:
    return isinstance(x, DTensorSpec)


def _shard_dim(spec: DTensorSpec) -> int | None:
    (p,) = spec.placements
    return p.dim if isinstance(p, Shard) else None


def _nbytes(x: fx.Node) -> int:
    v = val(x)
    return v.numel() * v.element_size()


def _refused(op: torch._ops.OpOverload) -> bool:
    """Ops a region on a share does not take: random ones (each rank would draw its share's
    numbers, not the model's), and those whose size arguments DTensor makes local beyond
    ``SHAPED`` (strides, backward shapes)."""
    sized = DTensor._op_dispatcher.sharding_propagator.op_to_shape_and_stride_idx
    random = torch.Tag.nondeterministic_seeded in op.tags
    return random or (op in sized and op not in SHAPED) or op in UNSIZED


# ops with sizes that neither DTensor nor ``SHAPED`` makes local
UNSIZED = frozenset({aten.unflatten.int, aten.as_strided.default})
# the ops whose argument 1 is a shape: its sharded dim becomes the local size
SHAPED = frozenset({
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
    aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
})  # fmt: skip


MAX_CUTS = 3  # inferences again after cutting regions (each cut ends one region early)


def reshard_plans(graph: fx.Graph, geo: Geometry, seeds: dict, group_name: str):
    """``(inference, plans, why)``: the placements, every gathered region's plan where one
    moves bytes off the gather (by member node), and for the members of the others why they
    stay gathered. A region whose op needs its dim whole (a norm over heads merged with the
    positions) is cut there where it can be: the values that op reads go back to the
    sequence, and the graph is inferred again from them."""
    cuts: dict[fx.Node, Seq] = {}
    first = None
    for _ in range(MAX_CUTS + 1):
        inference = infer_placements(graph, geo, seeds | cuts)
        plans: dict[fx.Node, Resharded] = {}
        why: dict[fx.Node, str] = {}
        if ring_by_name(group_name).group is None:  # no ring to ask DTensor (a pass alone)
            return inference, plans, why
        more: dict[fx.Node, Seq] = {}
        for nodes in regions(graph, inference.decisions):
            plan = plan_region(nodes, inference.place.of, geo, group_name)
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


def _cut(nodes: list[fx.Node], failed: fx.Node, place, geo: Geometry, group_name: str, why: str):
    """The cut of a region before ``failed``, or ``why`` where its first part plans nothing
    or a value it hands on has no sequence dim of its own."""
    head = nodes[: nodes.index(failed)]
    if not head or not isinstance(plan_region(head, place, geo, group_name, cut=False), Resharded):
        return why
    inside = set(head)
    exits = {}
    for m in head:
        if any(u not in inside for u in m.users) and is_tensor(m):
            dims = [d for d, size in enumerate(shape(m)) if size == geo.length]
            if len(dims) != 1:
                return why
            exits[m] = Seq(dims[0])
    return Cut(exits, why)


def rewrite_member(node: fx.Node, plan: Resharded, state: PassState) -> None:
    """``node`` on this rank's share: its inputs moved onto their dims (or gathered), whole
    operands it reads as a share sliced, its shape arguments local; a value that a sharded
    op reads back is gathered on its dim, which the crossing into the sequence replaces by
    the all-to-all (``PassState.slice``)."""
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
    if node.target in SHAPED and isinstance(d, int) and node.args[1][d] != -1:
        sizes = list(node.args[1])
        sizes[d] //= state.geo.ring_size
        node.args = (node.args[0], sizes, *node.args[2:])
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
    moved = sum(_nbytes(x) for x, d in plan.inputs.items() if d is not None)
    return ReshardedRegion(plan.nodes[0].name, len(plan.nodes), entered, whole, moved)
