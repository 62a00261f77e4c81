"""The integers a rewritten graph derives from its sequence length, read at run time.

``ringify/tracing/lengths.py`` runs the pass at several lengths; here the graphs are compared node
for node, each integer argument that differs between them is fitted exactly as
(a L + b Lp + c) / d of the length L and the padded length Lp, and in one of the graphs each
becomes a node computing it from an input's size (``sym_size``): one graph for every length.
A no-grad region export wrapped and the folds left (one reading its own attributes) makes
the graph not liftable: Dynamo cannot trace such a region once the length is symbolic.
"""

from __future__ import annotations

import math
import operator
from fractions import Fraction

import torch
from torch import fx
from torch._higher_order_ops.wrap import wrap_with_set_grad_enabled


class NotLiftable(Exception):
    """The model's graph is not one graph for every length; the message says why."""


def check_no_wrapped_regions(gm: fx.GraphModule) -> None:
    """Raise unless the folds inlined every region export wrapped in
    ``wrap_with_set_grad_enabled`` (``folds/wrapped.py``): Dynamo cannot trace such a region
    once the length is symbolic."""
    for node in gm.graph.nodes:
        if node.target is wrap_with_set_grad_enabled:
            raise NotLiftable(f"{node.name}: a no-grad region left as a submodule")


def fitted_integers(graphs: list[fx.Graph], lengths: list[int], m: int) -> dict:
    """(node index, path in its args) -> (a, b, c, d): the int there is (a L + b Lp + c) / d."""
    nodes = [list(g.nodes) for g in graphs]
    if len({len(n) for n in nodes}) != 1:
        raise NotLiftable("the graphs of different lengths differ in their nodes")
    # a node is known by its place: names count what a fold removed (a loop over positions)
    places = {n: i for graph in nodes for i, n in enumerate(graph)}
    lifts = {}
    for index, column in enumerate(zip(*nodes, strict=True)):
        if len({(n.op, n.target if n.op != "placeholder" else 0) for n in column}) != 1:
            raise NotLiftable(f"{column[0].name}: the graphs differ at this node")
        values = [(n.args, n.kwargs) for n in column]
        for path, found in _differences(values, (), places):
            if not all(type(v) is int for v in found):
                raise NotLiftable(f"{column[0].name}: {found} differ with the length")
            lifts[index, path] = _fit(found, lengths, m)
    return lifts


def _differences(values: list, path: tuple, places: dict):
    """(path, values) of each leaf where the probes' arguments differ."""
    first = values[0]
    if isinstance(first, (tuple, list)):
        if len({len(v) if isinstance(v, (tuple, list)) else -1 for v in values}) != 1:
            raise NotLiftable("arguments of different lengths")
        for k in range(len(first)):
            yield from _differences([v[k] for v in values], (*path, k), places)
    elif isinstance(first, dict):
        if len({tuple(v) for v in values}) != 1:
            raise NotLiftable("keyword arguments differ")
        for k in first:
            yield from _differences([v[k] for v in values], (*path, k), places)
    elif isinstance(first, fx.Node):
        if len({places[v] for v in values}) != 1:
            raise NotLiftable("the graphs read different nodes")
    elif any(type(v) is not type(first) or v != first for v in values):
        yield path, values


def _fit(values: list[int], lengths: list[int], m: int) -> tuple[int, int, int, int]:
    """Exact (a, b, c, d) with value = (a L + b Lp + c) / d on the first three probes, checked
    on the rest."""
    if all(padded(n, m) == n for n in lengths):  # no padding: Lp is L, fit (a L + c) / d
        a = Fraction(values[1] - values[0], lengths[1] - lengths[0])
        b, c = Fraction(0), values[0] - a * lengths[0]
    else:
        a, b, c = _solve([[n, padded(n, m), 1] for n in lengths[:3]], values[:3])
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


def padded(n: int, m: int) -> int:
    return -(-n // m) * m


def _value(coefficients, n: int, m: int):
    a, b, c, d = coefficients
    total = a * n + b * padded(n, m) + c
    return total // d if total % d == 0 else None


def read_at_run_time(graph: fx.Graph, lifts: dict, dims, m: int) -> None:
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
