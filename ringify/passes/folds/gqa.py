"""Grouped-query attention kept grouped: K/V heads repeated for SDPA are folded back.

HF's ``repeat_kv`` (Llama, Mistral, Qwen, Gemma and most decoders whose attention gets a
mask) repeats each of the K key/value heads H/K times before SDPA::

    k = k_BKSD[:, :, None].expand(B, K, n, S, D).reshape(B, K * n, S, D)

which SDPA's ``enable_gqa=True`` means on ``k_BKSD`` itself (query head h reads kv head
h // n); so does ``k_BKSD.repeat_interleave(n, dim=1)``. ``fold_repeated_kv`` runs on the
exported graph before the pass and hands each such SDPA (or attention with sinks or a soft
cap) the unrepeated K and V with ``enable_gqa=True``: the ring then sends K heads, not H
(Llama-3-8B: 4x fewer bytes), and its kernels take GQA natively. A K or V that is repeated
otherwise (another order, another count than the other) is left as it is.
"""

from __future__ import annotations

import sys

import torch
from torch import fx

from ringify.passes.graph.nodes import shape
from ringify.passes.graph.vocabulary import SIZED_VIEWS
from ringify.runtime.attention.reference import attention as reference_attention

aten = torch.ops.aten


def fold_repeated_kv(gm: fx.GraphModule) -> int:
    """Rewrite every SDPA whose K and V are repeated per head as above; how many."""
    graph = gm.graph
    folded = 0
    for node in graph.nodes:
        if node.target not in (aten.scaled_dot_product_attention.default, reference_attention):
            continue
        repeated = node.args[1:3]
        (k, k_groups), (v, v_groups) = (_unrepeated(x) for x in repeated)
        if k is None or v is None or k_groups != v_groups:
            continue
        node.update_arg(1, k)
        node.update_arg(2, v)
        node.update_kwarg("enable_gqa", True)
        for x in repeated:
            _erase_if_unused(graph, x)
        folded += 1
    return folded


def _erase_if_unused(graph: fx.Graph, x: fx.Node) -> None:
    """The reshape, expand and unsqueeze of a repeat that nothing else reads."""
    for _ in range(4):  # reshape, expand, a whole-dim slice, unsqueeze (or repeat_interleave)
        if x.users or x.op != "call_function":
            return
        source = x.args[0]
        graph.erase_node(x)
        x = source


def _unsliced(x):
    """``x`` through slices that keep a whole dim (a traced dynamic length leaves them)."""
    while (
        isinstance(x, fx.Node)
        and x.target is aten.slice.Tensor
        and list(x.args[2:]) in ([], [0], [0, sys.maxsize], [0, sys.maxsize, 1])
    ):
        x = x.args[0]
    return x


def _unrepeated(x: fx.Node) -> tuple[fx.Node | None, int]:
    """``(y, n)`` if ``x`` is ``y`` (B, K, S, D) with each head repeated ``n`` times in
    place (heads k*n .. k*n + n - 1 are copies of head k), else ``(None, 0)``."""
    if isinstance(x, fx.Node) and x.target is aten.repeat_interleave.self_int:
        y, n = x.args[:2]
        dim = x.args[2] if len(x.args) > 2 else x.kwargs.get("dim")
        if len(shape(y)) == 4 and dim in (1, -3) and isinstance(n, int):
            return y, n
        return None, 0
    if not (isinstance(x, fx.Node) and x.target in SIZED_VIEWS):
        return None, 0
    expanded = x.args[0]
    if not (isinstance(expanded, fx.Node) and expanded.target is aten.expand.default):
        return None, 0
    inserted = _unsliced(expanded.args[0])
    if not (isinstance(inserted, fx.Node) and inserted.target is aten.unsqueeze.default):
        return None, 0
    y = inserted.args[0]
    if inserted.args[1] not in (2, -3) or len(shape(y)) != 4:
        return None, 0
    b, k, s, d = shape(y)
    wide = shape(expanded)
    if len(wide) != 5 or [wide[0], wide[1], wide[3], wide[4]] != [b, k, s, d]:
        return None, 0
    if shape(x) != [b, k * wide[2], s, d]:
        return None, 0
    return y, wide[2]
