"""One trace for many sequence lengths: the rewritten graph with its lengths read at run time.

The pass rewrites a graph traced at one length, and the integers it writes (local and
padded lengths, pad amounts, ``key_len``, slice bounds, reshapes) follow from that
length. When a model is called with a second length of the same inputs (only the
sequence dims differ), ``lift_lengths`` traces it once for all lengths:

1. A symbolic export (``torch.export``, the sequence dims ``Dim.AUTO``) says whether the
   model's graph is one graph for every length: the dims must stay symbolic, and every
   size must be affine in the length (a ``Min`` from a fixed-size slice, say, is not).
   Its range constraints are the lengths the graph holds for.
2. The pass runs at four lengths with its padding steps always in (``general``), and the
   four graphs must match node for node. Every integer that differs is an affine function
   of the length L and the padded length Lp, fitted exactly on three and checked on the
   fourth; any other difference (a float, a string) refuses.
3. In the graph of the call's own length each such integer becomes a node computing it
   from the sequence input's size at run time.

A length outside the range, or a model refused here, is traced per length as before, and
the report and the log say why (``Report.lengths``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import operator
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch import fx, nn
from torch._higher_order_ops.wrap import wrap_with_set_grad_enabled
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import Dim
from torch.export.graph_signature import InputKind
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils import _pytree as pytree

from ringify.config import Config
from ringify.parallelized import fsdp_units, unsharded_for_trace
from ringify.passes.nodes import val
from ringify.runtime.tiling.layout import split_multiple
from ringify.trace import Rewritten, rewrite

log = logging.getLogger("ringify")


class NotLiftable(Exception):
    """The model's graph is not one graph for every length; the message says why."""


@dataclass(frozen=True)
class Lengths:
    """The sequence inputs (flat index -> dim) and the lengths a lifted graph holds for."""

    dims: tuple[tuple[int, int], ...]
    low: int
    high: float
    multiple: int = 1  # only lengths that are multiples of this (outputs="sharded")

    def holds(self, key: tuple) -> bool:
        """Whether a call of signature ``key`` (same family) has a length in range."""
        i, d = self.dims[0]
        length = key[1][i][0][d]
        return self.low <= length <= self.high and length % self.multiple == 0

    def __str__(self) -> str:
        high = "" if self.high == float("inf") else f" to {int(self.high)}"
        every = f", a multiple of {self.multiple}" if self.multiple > 1 else ""
        return (
            f"any length from {self.low}{high}{every} (one graph; the length is read at run time)"
        )


def sequence_dims(before: tuple, now: tuple) -> tuple[tuple[int, int], ...] | None:
    """The (flat index, dim) that differ between two calls' signatures (``module._signature``:
    structure, each input's (shape, dtype, device, requires_grad) or value, modes), if
    those are all of one length before and one now and nothing else differs; else ``None``."""
    (spec, inputs, modes), (spec_now, inputs_now, modes_now) = before, now
    if spec != spec_now or modes != modes_now or len(inputs) != len(inputs_now):
        return None
    changed, lengths = [], set()
    for i, (a, b) in enumerate(zip(inputs, inputs_now, strict=True)):
        tensors = isinstance(a, tuple) and isinstance(b, tuple)
        if not tensors or a[1:] != b[1:] or len(a[0]) != len(b[0]):
            if a != b:
                return None
            continue
        for d, (x, y) in enumerate(zip(a[0], b[0], strict=True)):
            if x != y:
                changed.append((i, d))
                lengths.add((x, y))
    return tuple(changed) if len(lengths) == 1 else None


def family(key: tuple, dims: tuple[tuple[int, int], ...]) -> tuple:
    """A signature with the sequence dims' sizes left out: the same for every length."""
    spec, inputs, modes = key
    inputs = list(inputs)
    for i, d in dims:
        shape = list(inputs[i][0])
        shape[d] = None
        inputs[i] = (tuple(shape), *inputs[i][1:])
    return spec, tuple(inputs), modes


def lift_lengths(
    model: nn.Module, config: Config, args, kwargs, dims: tuple[tuple[int, int], ...]
) -> tuple[Rewritten, Lengths]:
    """The rewritten graph of this call, its lengths read at run time; ``NotLiftable``."""
    if config.inputs == "sharded" or config.dilation is not None:
        raise NotLiftable("inputs='sharded' and dilation trace per length")
    flat, spec = pytree.tree_flatten((args, kwargs))
    length = flat[dims[0][0]].shape[dims[0][1]]
    low, high = _symbolic_range(model, flat, spec, dims)
    m = split_multiple(config.ring_size, config.layout)
    # outputs="sharded" takes no padding: lengths the ring splits evenly, one graph for them
    multiple = m if config.outputs == "sharded" else 1
    probes = [length + k * m for k in range(4)] if multiple > 1 else _probes(length, m)
    done = []
    for n in probes:
        shapes = {i: _resized(flat[i].shape, d, n) for i, d in dims} if n != length else {}
        try:
            done.append(rewrite(model, config, args, kwargs, shapes, general=True))
        except Exception as e:  # e.g. a length the model's position table cannot hold
            raise NotLiftable(f"the pass at length {n} failed ({type(e).__name__})") from e
    for r in done:
        _inline_no_grad_regions(r.gm)
    lifts = _lifts([r.gm.graph for r in done], probes, m)
    _lift(done[0].gm.graph, lifts, dims, m)
    return done[0], Lengths(dims, max(low, 2), high, multiple)


def _probes(length: int, m: int) -> list[int]:
    """The call's length, two more whose (L, Lp) are not collinear with it (so that the fit
    is determined), and one to check the fit on: near the call's length, padded variously."""
    chosen = [length]
    for n in range(length + 1, length + 3 * m + 3):
        if len(chosen) == 3:
            break
        if len(chosen) == 1 or _determinant([*chosen, n], m) != 0:
            chosen.append(n)
    return [*chosen, chosen[-1] + m + 1]


def _determinant(lengths: list[int], m: int) -> int:
    (a, b), (c, d), (e, f) = ((n, _padded(n, m)) for n in lengths)
    return (c - a) * (f - b) - (d - b) * (e - a)


def _inline_no_grad_regions(gm: fx.GraphModule) -> None:
    """Inline the regions export wrapped in ``wrap_with_set_grad_enabled`` where no input
    requires a gradient (RoPE's ``torch.no_grad()`` block), where that changes nothing:
    Dynamo cannot trace such a region once the length is symbolic."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target is not wrap_with_set_grad_enabled:
            continue
        _, body, *inputs = node.args
        if any(getattr(val(x), "requires_grad", False) for x in inputs):
            raise NotLiftable(f"{node.name}: a no-grad region reads tensors that require grad")
        sub = getattr(gm, body.target)
        if any(n.op in ("get_attr", "call_module") for n in sub.graph.nodes):
            raise NotLiftable(f"{node.name}: a no-grad region reads its own attributes")
        values = dict(
            zip([n for n in sub.graph.nodes if n.op == "placeholder"], inputs, strict=True)
        )
        with graph.inserting_before(node):
            outputs = graph.graph_copy(sub.graph, values)
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise NotLiftable(f"{node.name}: a no-grad region's outputs read whole")
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        if not body.users:
            graph.erase_node(body)
            delattr(gm, body.target)
    graph.lint()


def _resized(shape, dim: int, n: int) -> list[int]:
    shape = list(shape)
    shape[dim] = n
    return shape


def _symbolic_range(model: nn.Module, flat: list, spec, dims) -> tuple[int, float]:
    """The lengths the model's graph holds for, from an export with a symbolic length."""
    args, kwargs = pytree.tree_unflatten(flat, spec)
    try:
        positional = list(inspect.signature(model.forward).bind_partial(*args).arguments)
        names = [*positional, *kwargs]  # the order ``_dynamic_shapes`` gives them in
        dynamic = dict(zip(names, _dynamic_shapes(spec, dims), strict=True))
        with _fsdp_units_whole(model):
            exported = torch.export.export(
                model, tuple(args), kwargs, dynamic_shapes=dynamic, strict=False
            )
    except Exception as e:
        raise NotLiftable(f"no export with a symbolic length ({type(e).__name__})") from e
    nodes = {n.name: n for n in exported.graph.nodes if n.op == "placeholder"}
    user = [s.arg for s in exported.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    sizes = [nodes[user[i].name].meta["val"].shape[d] for i, d in dims]
    if not all(isinstance(n, torch.SymInt) for n in sizes):
        raise NotLiftable("the export fixed the length (the model branches on it)")
    symbol = sizes[0].node.expr
    # every input's length is the one length (the family's): one symbol for all of them
    same = {n.node.expr: symbol for n in sizes[1:] if n.node.expr.is_Symbol}
    for node in exported.graph.nodes:
        value = node.meta.get("val")
        for n in value.shape if isinstance(value, torch.Tensor) else ():
            expr = n.node.expr.xreplace(same) if isinstance(n, torch.SymInt) else None
            if expr is not None and not _affine(expr, symbol):
                raise NotLiftable(f"{node.name} is {expr} long, not affine in the length")
    bounds = exported.range_constraints[symbol]
    return int(bounds.lower), float(bounds.upper)


@contextlib.contextmanager
def _fsdp_units_whole(model: nn.Module):
    """FSDP2 units seen whole, as the trace sees them (``unsharded_for_trace``): their full
    parameters are fakes of the export's own fake mode, which export then takes as its own."""
    units = fsdp_units(model)
    if not units:
        yield
        return
    mode = FakeTensorMode(
        shape_env=ShapeEnv(tracked_fakes=[]), allow_non_fake_inputs=True, export=True
    )
    with (
        torch._guards.tracing(torch._guards.TracingContext(mode)),
        unsharded_for_trace(units, mode),
    ):
        yield


def _dynamic_shapes(spec, dims) -> tuple:
    """export's dynamic shapes: per argument (positional, then keyword), its sequence dims
    ``Dim.AUTO``; ``None`` for an argument with none (a cache object, a flag)."""
    marked: dict[int, dict] = {}
    for i, d in dims:
        marked.setdefault(i, {})[d] = Dim.AUTO
    shapes, start = [], 0
    args_spec, kwargs_spec = spec.children()
    for child in [*args_spec.children(), *kwargs_spec.children()]:
        leaves = range(start, start + child.num_leaves)
        start += child.num_leaves
        if child.is_leaf():
            shapes.append(marked.get(leaves[0]))
        else:
            shapes.append(_as_containers(child, iter(marked.get(i) for i in leaves)))
    return tuple(shapes)


def _as_containers(spec, values):
    """``spec``'s tree with ``values`` at its leaves, a node of another type than a list,
    tuple or dict (an HF cache) as the list of its children, as export expects it."""
    if spec.is_leaf():
        return next(values)
    children = [_as_containers(c, values) for c in spec.children()]
    if spec.type is dict:
        return dict(zip(spec.context, children, strict=True))
    return tuple(children) if spec.type is tuple else children


def _affine(expr, symbol) -> bool:
    """Whether the size ``expr`` (a sympy expression of the shape environment) is a + b L."""
    poly = expr.as_poly(symbol) if expr.free_symbols <= {symbol} else None
    return poly is not None and poly.degree() <= 1


def _lifts(graphs: list[fx.Graph], lengths: list[int], m: int) -> dict:
    """(node index, path in its args) -> (a, b, c, d): the int there is (a L + b Lp + c) / d."""
    nodes = [list(g.nodes) for g in graphs]
    if len({len(n) for n in nodes}) != 1:
        raise NotLiftable("the graphs of different lengths differ in their nodes")
    lifts = {}
    for index, column in enumerate(zip(*nodes, strict=True)):
        if len({(n.op, n.target if n.op != "placeholder" else 0) for n in column}) != 1:
            raise NotLiftable(f"{column[0].name}: the graphs differ at this node")
        values = [(n.args, n.kwargs) for n in column]
        for path, found in _differences(values, ()):
            if not all(type(v) is int for v in found):
                raise NotLiftable(f"{column[0].name}: {found} differ with the length")
            lifts[index, path] = _fit(found, lengths, m)
    return lifts


def _differences(values: list, path: tuple):
    """(path, values) of each leaf where the probes' arguments differ."""
    first = values[0]
    if isinstance(first, (tuple, list)):
        if len({len(v) if isinstance(v, (tuple, list)) else -1 for v in values}) != 1:
            raise NotLiftable("arguments of different lengths")
        for k in range(len(first)):
            yield from _differences([v[k] for v in values], (*path, k))
    elif isinstance(first, dict):
        if len({tuple(v) for v in values}) != 1:
            raise NotLiftable("keyword arguments differ")
        for k in first:
            yield from _differences([v[k] for v in values], (*path, k))
    elif isinstance(first, fx.Node):
        if len({v.name for v in values}) != 1:
            raise NotLiftable("the graphs read different nodes")
    elif any(type(v) is not type(first) or v != first for v in values):
        yield path, values


def _fit(values: list[int], lengths: list[int], m: int) -> tuple[int, int, int, int]:
    """Exact (a, b, c, d) with value = (a L + b Lp + c) / d on the first three probes, checked
    on the rest."""
    if all(_padded(n, m) == n for n in lengths):  # no padding: Lp is L, fit (a L + c) / d
        a = Fraction(values[1] - values[0], lengths[1] - lengths[0])
        b, c = Fraction(0), values[0] - a * lengths[0]
    else:
        a, b, c = _solve([[n, _padded(n, m), 1] for n in lengths[:3]], values[:3])
    d = math.lcm(a.denominator, b.denominator, c.denominator)
    coefficients = (int(a * d), int(b * d), int(c * d), int(d))
    for n, v in zip(lengths, values, strict=True):
        if _value(coefficients, n, m) != v:
            raise NotLiftable(f"an integer {values} is not affine in the length")
    return coefficients


def _solve(rows: list[list[int]], values: list[int]) -> list[Fraction]:
    """The exact solution x of rows x = values (3 x 3, non-singular: ``_probes`` sees to it),
    by Cramer's rule."""

    def det(r):
        return (
            r[0][0] * (r[1][1] * r[2][2] - r[1][2] * r[2][1])
            - r[0][1] * (r[1][0] * r[2][2] - r[1][2] * r[2][0])
            + r[0][2] * (r[1][0] * r[2][1] - r[1][1] * r[2][0])
        )

    whole = det(rows)
    if whole == 0:
        raise NotLiftable("the probe lengths do not separate L from its padding")
    columns = [
        [[values[i] if j == k else rows[i][j] for j in range(3)] for i in range(3)]
        for k in range(3)
    ]
    return [Fraction(det(c), whole) for c in columns]


def _padded(n: int, m: int) -> int:
    return -(-n // m) * m


def _value(coefficients, n: int, m: int):
    a, b, c, d = coefficients
    total = a * n + b * _padded(n, m) + c
    return total // d if total % d == 0 else None


def _lift(graph: fx.Graph, lifts: dict, dims, m: int) -> None:
    """Replace each lifted integer of ``graph`` by a node computing it at run time."""
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    anchor = placeholders[-1].next  # every node made here goes before it, in order
    with graph.inserting_before(anchor):
        seq_input, seq_dim = placeholders[dims[0][0]], dims[0][1]
        length = graph.call_function(torch.ops.aten.sym_size.int, (seq_input, seq_dim))
    made = {}

    def node_for(coefficients):
        if coefficients not in made:
            with graph.inserting_before(anchor):
                made[coefficients] = _expression(graph, length, *coefficients, m)
        return made[coefficients]

    paths: dict[int, list] = {}
    for (index, path), coefficients in lifts.items():
        paths.setdefault(index, []).append((path, node_for(coefficients)))
    for index, replaced in paths.items():
        node = nodes[index]
        args, kwargs = node.args, node.kwargs
        for path, value in replaced:
            args, kwargs = _set((args, kwargs), path, value)
        node.args, node.kwargs = args, kwargs
    graph.lint()


def _expression(graph: fx.Graph, length: fx.Node, a, b, c, d, m) -> fx.Node:
    """Nodes computing (a L + b Lp + c) // d, Lp = ceil(L / m) m; the last is returned."""
    call = graph.call_function
    total = call(operator.mul, (length, a)) if a else None
    if b:
        rounded = call(
            operator.mul, (call(operator.floordiv, (call(operator.add, (length, m - 1)), m)), m)
        )
        term = call(operator.mul, (rounded, b))
        total = term if total is None else call(operator.add, (total, term))
    total = c if total is None else call(operator.add, (total, c))
    return call(operator.floordiv, (total, d)) if d != 1 else total


def _set(value, path: tuple, new):
    """``value`` with the leaf at ``path`` replaced (tuples rebuilt, lists and dicts copied)."""
    if not path:
        return new
    key, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, key: _set(value[key], rest, new)}
    items = list(value)
    items[key] = _set(items[key], rest, new)
    return type(value)(items) if isinstance(value, tuple) else items
