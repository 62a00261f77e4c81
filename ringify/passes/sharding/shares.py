"""Which dims each op of a region keeps independent: DTensor's sharding propagation, asked.

``propagated`` walks a region (``resharded.py``) op by op with ``Shard(dim)`` and
``Replicate`` specs of the global values (no tensor is made) and gives its ``Resharded``
plan, or None where an op would need a collective: a dim it contracts or reduces, a
partial sum, an uneven share. A whole operand an op asks to shard (a per-head parameter)
is read as this rank's share of it. ``einsum``, ``matmul`` (which DTensor decomposes at
run time) and ``tril`` get a few lines of their own; random ops are refused.
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

from ringify.passes.graph.nodes import is_tensor, shape, val
from ringify.passes.graph.vocabulary import ASSERTS, DIM_VIEWS, SHAPED, TRIANGLES
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
        return sum(nbytes(x) for x, d in self.inputs.items() if d is None)

    def gathers_for(self, node: fx.Node) -> bool:
        """Whether ``node`` is the first to read an input that still enters whole (gathered):
        the gather reported once."""
        return any(self.read.get(a) is node for a, d in self.inputs.items() if d is None)


def propagated(nodes, members, inputs, seeds, mesh, failed: list) -> Resharded | None:
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
    if node.target is aten.dropout.default and (node.args[1] == 0 or not node.args[2]):
        return plan.dims[node.args[0]] if node.args[0] in members else plan.inputs.get(node.args[0])
    if not isinstance(node.target, torch._ops.OpOverload) or _refused(node.target):
        return False

    def spec(a: fx.Node) -> DTensorSpec:
        d = plan.dims[a] if a in members else plan.inputs.get(a)
        return spec_of(mesh, val(a), d)

    if node.target is aten.einsum.default:
        equation, operands = node.args
        return _einsum(node, equation, operands, [spec(a) for a in operands], plan)
    if node.target in TRIANGLES:  # no DTensor rule: batch dims
        d = spec(node.args[0]) and _shard_dim(spec(node.args[0]))
        return d if d is None or d < len(shape(node)) - 2 else False
    if node.target is aten.matmul.default:
        equation = _matmul_equation(*(len(shape(a)) for a in node.args[:2]))
        operands = node.args[:2]
        return equation and _einsum(node, equation, operands, [spec(a) for a in operands], plan)
    args, kwargs = fx.node.map_aggregate(
        (node.args, node.kwargs), lambda a: spec(a) if isinstance(a, fx.Node) and is_tensor(a) else a
    )  # fmt: skip
    target = node.target
    if target in DIM_VIEWS:  # no DTensor rule: asked as
        target, args = aten.reshape.default, (args[0], shape(node))  # the view each one is
    try:
        out = ask(target, tuple(args), dict(kwargs))
    except Exception:  # no strategy for the op: the region stays gathered
        return False
    if out.needs_redistribute:
        wanted = out.redistribute_schema
        have = [x for x in pytree.tree_leaves((args, kwargs), is_leaf=_is_spec) if _is_spec(x)]
        want = pytree.tree_leaves((wanted.args_schema, wanted.kwargs_schema), is_leaf=_is_spec)
        want = [x for x in want if _is_spec(x)]
        operands = [
            a for a in pytree.tree_leaves((node.args, node.kwargs))
            if isinstance(a, fx.Node) and is_tensor(a)
        ]  # fmt: skip
        if not len(operands) == len(have) == len(want):
            return False  # a schema rewritten beyond its tensors: not read
        for a, h, w in zip(operands, have, want, strict=True):
            if h.placements == w.placements:
                continue
            d = _shard_dim(w)
            if d is None or _shard_dim(h) is not None:
                return False  # a collective inside the region
            _read_as_share(plan, node, a, d)
    return _placed(out.output_spec, mesh.size())


def ask(op: torch._ops.OpOverload, args: tuple, kwargs: dict):
    """DTensor's ``OutputSharding`` of ``op`` on these specs, asked as its dispatcher asks:
    the op's schema info makes its non-tensor arguments (a view's shape) part of the key
    the answers are cached under."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    info = propagator.op_to_schema_info.get(op)
    info = info or propagator.op_to_schema_info_for_single_dim_strategy.get(op)
    return propagator.propagate_op_sharding(OpSchema(op, args, kwargs, schema_info=info))


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


def mesh_of(group_name: str, device_type: str) -> DeviceMesh:
    return DeviceMesh.from_group(ring_by_name(group_name).group, device_type)


def spec_of(mesh: DeviceMesh, value: torch.Tensor, dim: int | None) -> DTensorSpec:
    placement = Replicate() if dim is None else Shard(dim)
    meta = TensorMeta(value.shape, value.stride(), value.dtype)
    return DTensorSpec(mesh, (placement,), tensor_meta=meta)


def _is_spec(x) -> bool:
    return isinstance(x, DTensorSpec)


def _shard_dim(spec: DTensorSpec) -> int | None:
    (p,) = spec.placements
    return p.dim if isinstance(p, Shard) else None


def nbytes(x: fx.Node) -> int:
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
UNSIZED = frozenset({aten.as_strided.default})
