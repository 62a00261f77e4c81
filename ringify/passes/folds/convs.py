"""Convolutions along the sequence, folded into one node (its rule: ``sharding/along.py``).

A model convolves along its sequence keeping its length: a stride-1 ``conv1d`` padded
by ``(kernel - 1) / 2`` on each side, or padded more and its output cut back to the
sequence's length: by ``kernel / 2`` with the last position cut off (Wav2Vec2's positional
convolution and its ``SamePad``), by ``kernel - 1`` with the first ``S`` kept (a causal
convolution: Mamba's, in hybrids such as Bamba and Jamba). ``fold_sequence_convs``
rewrites each into one call of ``same_conv1d`` (``ringify/runtime/collectives/neighbours.py``)
before the plan reads the graph. Along the sharded sequence it becomes ``ring_conv1d``:
a halo exchange of kernel-width rows per chunk, not a gather; along the batch, local.
"""

from __future__ import annotations

import torch
from torch import fx

from ringify.passes.graph.nodes import replace_by_call, shape, slice_bounds
from ringify.runtime.collectives.neighbours import same_conv1d

aten = torch.ops.aten


def fold_sequence_convs(gm: fx.GraphModule) -> int:
    """Replace every length-keeping stride-1 ``conv1d`` (and its cut) by ``same_conv1d``."""
    graph = gm.graph
    folded = 0
    for node in list(graph.nodes):
        found = _same_conv(node)
        if found is None:
            continue
        last, args = found
        replace_by_call(graph, last, same_conv1d, args)
        for dead in (last, node) if last is not node else (node,):
            graph.erase_node(dead)
        folded += 1
    return folded


def _same_conv(node: fx.Node) -> tuple[fx.Node, tuple] | None:
    """``(the node whose value is the same-length convolution, same_conv1d's arguments)``."""
    if node.op != "call_function" or node.target is not aten.conv1d.default:
        return None
    x, weight, bias, stride, padding, dilation, groups = (
        list(node.args) + [None, [1], [0], [1], 1][len(node.args) - 2 :]
    )
    if len(shape(x)) != 3 or list(stride) != [1] or list(dilation) != [1]:
        return None
    if isinstance(padding, str) or len(padding) != 1:
        return None
    kernel, pad, length = shape(weight)[-1], padding[0], shape(x)[-1]
    if 2 * pad == kernel - 1:
        return node, (x, weight, bias, pad, pad, groups)
    cut = next(iter(node.users)) if len(node.users) == 1 else None
    if cut is None or cut.target is not aten.slice.Tensor or cut.args[1] not in (2, -1):
        return None
    start, end, step = slice_bounds(cut, shape(node)[-1])
    left = pad - start  # the cut's first output reads ``left`` positions before the first
    right = kernel - 1 - left
    if step != 1 or end - start != length or not (0 <= left <= pad and 0 <= right <= pad):
        return None
    return cut, (x, weight, bias, left, right, groups)
