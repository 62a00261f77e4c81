"""Mamba-1's recurrence and diagonal linear RNNs, which export unrolls over the positions,
folded into one node (its rule, and a running sum's: ``sharding/along.py``).

A ``cumsum`` along the sequence is a scan over the ring (``ring_cumsum``: each chunk's total
gathered, an exclusive sum of those before it added); off the sequence it stays local.

The torch path of HF's Mamba-1 mixers (Mamba, FalconMamba, Jamba, Zamba) runs its
selective scan as a Python loop over positions, which ``torch.export`` unrolls into S
copies of one step::

    h = a[:, :, i] * h + b[:, :, i]                      (h: zeros before the first step)
    y_i = matmul(h.to(dtype), c[:, i].unsqueeze(-1))[:, :, 0]
    y = stack([y_0, ..., y_{S-1}], -1)

``fold_selective_scans`` finds that chain, position by position, and replaces it by one
``selective_scan(a, b, c)`` node (``runtime/selective_scan.py``). A diagonal linear RNN
(RecurrentGemma's RG-LRU) that writes each state into a buffer of the outputs::

    h = a[:, i] * h + x[:, i]                            (h: zeros before the first step)
    y[:, i] = h.to(dtype)                                 (y: zeros_like(x) before)

is the same scan with a state of one number per channel and ``c`` one:
``fold_linear_recurrences`` folds it into ``selective_scan`` of a and x moved to (B, D, S, 1). The graph no longer grows
with the length, and along a sharded sequence the scan becomes ``ring_selective_scan``:
state passing between the ring's chunks. A chain that is not exactly this (its last state
read elsewhere, say) is left as it is: a region on a share of the channels
(``passes/sharding/resharded.py``), its ``c``, one row per position shared by every channel, gathered.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
from torch import fx

from ringify.passes.graph.nodes import (
    call,
    erase_unused,
    norm_dim,
    replace_by_call,
    shape,
    uses,
    val,
)
from ringify.passes.graph.vocabulary import ANY_CAST, ZEROS
from ringify.runtime.selective_scan import selective_scan

aten = torch.ops.aten
_WRITTEN_THROUGH = ANY_CAST | {aten.clone.default}  # what a write into a buffer reads a state by


def fold_selective_scans(gm: fx.GraphModule) -> int:
    """Replace every unrolled Mamba-1 scan (a ``stack`` of its per-position outputs)."""
    graph = gm.graph
    folded = 0
    for node in list(graph.nodes):
        found = _scan_of(node) if node.op == "call_function" else None
        if found is None:
            continue
        replace_by_call(graph, node, selective_scan, found)
        erase_unused(graph, node)
        folded += 1
    return folded


class _Step(NamedTuple):
    """One position of the unrolled loop: ``after = a[:, :, i] * before + b[:, :, i]`` (the
    product ``decayed``), and its output's ``product`` with ``c[:, i]``."""

    a: fx.Node
    b: fx.Node
    c: fx.Node
    before: fx.Node
    after: fx.Node
    decayed: fx.Node
    product: fx.Node


def _scan_of(stack: fx.Node) -> tuple | None:
    """``selective_scan``'s arguments if ``stack`` stacks an unrolled scan's outputs."""
    if stack.target is not aten.stack.default or len(shape(stack)) != 3:
        return None
    outs, dim = stack.args[0], stack.args[1] if len(stack.args) > 1 else 0
    if norm_dim(dim, 3) != 2 or len(outs) != shape(stack)[2]:
        return None
    steps = [_step(y, i) for i, y in enumerate(outs)]
    if any(s is None for s in steps):
        return None
    first = steps[0]
    if len(shape(first.a)) != 4 or shape(first.b) != shape(first.a):
        return None
    batch, _, length, state = shape(first.a)
    if shape(first.c) != [batch, length, state]:
        return None
    if any(s[:3] != first[:3] for s in steps) or first.before.target not in ZEROS:
        return None
    for before, after in itertools.pairwise(steps):
        if after.before is not before.after and _alias_of(after.before) is not before.after:
            return None
    # each state is read by its own output and the next step alone (a cache would read more)
    readers = [{s.product, *([after.decayed] if after else [])} for s, after in
               zip(steps, [*steps[1:], None], strict=True)]  # fmt: skip
    if any(not _read_only_by(s.after, r) for s, r in zip(steps, readers, strict=True)):
        return None
    return first.a, first.b, first.c, val(first.after).dtype, val(stack).dtype


def _step(y: fx.Node, i: int) -> _Step | None:
    """Position ``i``'s step, read back from its output ``y``."""
    if not isinstance(y, fx.Node) or y.target is not aten.select.int or y.args[2] != 0:
        return None
    product = y.args[0]
    if product.target is not aten.matmul.default or norm_dim(y.args[1], 3) != 2:
        return None
    state, column = product.args
    h = state.args[0] if state.target in ANY_CAST else state
    c = _position(column.args[0], i) if column.target is aten.unsqueeze.default else None
    if c is None or c[1] != 1 or norm_dim(column.args[1], 3) != 2 or len(shape(c[0])) != 3:
        return None
    found = _linear_step(h, i, 2)
    if found is None:
        return None
    a, b, before, decayed = found
    return _Step(a, b, c[0], before, h, decayed, product)


def _linear_step(h, i: int, dim: int, read=lambda node: node) -> tuple | None:
    """``(a, b, the state before, the product)`` if ``h = a[i] * before + b[i]``, a and b
    selected at ``i`` along ``dim``, each selected row read through ``read`` (a cast)."""
    if not isinstance(h, fx.Node) or h.target is not aten.add.Tensor or len(h.args) != 2:
        return None
    if h.kwargs.get("alpha", 1) != 1:
        return None
    for decayed, added in (h.args, h.args[::-1]):
        b = _position(read(added), i)
        if b is None or b[1] != dim or getattr(decayed, "target", None) is not aten.mul.Tensor:
            continue
        for factor, before in (decayed.args, decayed.args[::-1]):
            a = _position(read(factor), i)
            if a is not None and a[1] == dim and isinstance(before, fx.Node):
                return a[0], b[0], before, decayed
    return None


def _position(node, i: int) -> tuple[fx.Node, int] | None:
    """``(x, dim)`` if ``node`` is ``x.select(dim, i)``."""
    if not isinstance(node, fx.Node) or node.target is not aten.select.int:
        return None
    x, dim, index = node.args
    ndim = len(shape(x))
    return (x, norm_dim(dim, ndim)) if index % shape(x)[norm_dim(dim, ndim)] == i else None


def _alias_of(node: fx.Node) -> fx.Node | None:
    """The state a same-dtype cast returns (``h.to(h.dtype)``, ``h.to(device)`` are ``h``)."""
    cast = node.target in ANY_CAST or node.target is aten.to.dtype_layout
    return node.args[0] if cast and val(node).dtype == val(node.args[0]).dtype else None


def _read_only_by(h: fx.Node, readers: set) -> bool:
    """Whether ``readers`` alone read the state ``h``, directly or through its cast."""
    for user in uses(h):
        if user.target in ANY_CAST and user not in readers:
            if not all(u in readers for u in uses(user)):
                return False
        elif user not in readers:
            return False
    return True


def fold_linear_recurrences(gm: fx.GraphModule) -> int:
    """Replace every unrolled diagonal linear RNN whose states are written into a buffer
    of the outputs (the last ``select_scatter`` of the chain) by one ``selective_scan``."""
    graph = gm.graph
    folded = 0
    for node in list(graph.nodes):
        if node.target is not aten.select_scatter.default:
            continue
        if any(u.target is aten.select_scatter.default and u.args[0] is node for u in node.users):
            continue  # not the chain's last write
        found = _recurrence_of(node)
        if found is None:
            continue
        a, x, state_dtype = found
        out_dtype = val(node).dtype
        with graph.inserting_before(node):
            a4, x4 = (_as_scanned(graph, t, state_dtype) for t in (a, x))
            column = call(graph, aten.slice.Tensor, (x, 2, 0, 1))
            ones = call(graph, aten.ones_like.default, (column,), {"dtype": out_dtype})
            y = call(graph, selective_scan, (a4, x4, ones, state_dtype, out_dtype))
            moved = call(graph, aten.transpose.int, (y, 1, 2))
            kept = {"memory_format": torch.contiguous_format}
            y = call(graph, aten.clone.default, (moved,), kept)
        node.replace_all_uses_with(y)
        erase_unused(graph, node)
        folded += 1
    return folded


def _as_scanned(graph: fx.Graph, t: fx.Node, dtype: torch.dtype) -> fx.Node:
    """(B, S, D) in ``dtype`` as a scan's (B, D, S, 1)."""
    if val(t).dtype != dtype:
        t = call(graph, aten._to_copy.default, (t,), {"dtype": dtype})
    return call(graph, aten.unsqueeze.default, (call(graph, aten.transpose.int, (t, 1, 2)), -1))


def _recurrence_of(last: fx.Node) -> tuple | None:
    """``(a, x, state dtype)`` if ``last`` writes the last state of an unrolled diagonal
    linear RNN into a (B, S, D) buffer of zeros, one ``select_scatter`` per position."""
    writes = [last]
    while writes[-1].args[0].target is aten.select_scatter.default:
        writes.append(writes[-1].args[0])
    writes.reverse()
    buffer, length = writes[0].args[0], len(writes)
    if buffer.target not in ZEROS or len(shape(buffer)) != 3 or shape(buffer)[1] != length:
        return None
    steps, chains = [], []  # each write's step, and what its value is read through
    for i, w in enumerate(writes):
        if w.args[2:] not in ((1, i), (-2, i)) or (i and len(uses(writes[i - 1])) != 1):
            return None
        chain = [w, w.args[1]]  # the write, then the clone and the cast it writes
        while isinstance(chain[-1], fx.Node) and chain[-1].target in _WRITTEN_THROUGH:
            chain.append(chain[-1].args[0])
        step = _linear_step(chain[-1], i, 1, _uncast)
        if step is None or any(len(uses(n)) != 1 for n in chain[1:-1]):
            return None
        steps.append(step)
        chains.append(chain)
    a, x, first = steps[0][:3]
    if any(s[:2] != (a, x) for s in steps) or (_alias_of(first) or first).target not in ZEROS:
        return None
    if shape(a) != shape(buffer) or shape(x) != shape(buffer):
        return None
    for i, chain in enumerate(chains):
        h = chain[-1]
        if i and (_alias_of(steps[i][2]) or steps[i][2]) is not chains[i - 1][-1]:
            return None
        # each state is read by its own write and the next step alone (a cache reads more)
        readers = {*chain, *(steps[i + 1][2:] if i + 1 < length else ())}
        if not _read_only_by(h, readers):
            return None
    return a, x, val(chains[0][-1]).dtype


def _uncast(node):
    return node.args[0] if isinstance(node, fx.Node) and node.target in ANY_CAST else node
