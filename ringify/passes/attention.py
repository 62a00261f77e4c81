"""Finding attention in an ATen graph, in any of the forms it takes there.

``aten.scaled_dot_product_attention`` is what models call; the lowered kernels
(flash, memory-efficient, cuDNN, CPU flash) appear when a graph was traced after
dispatch or a model calls them directly. All are read into one ``Attention``.
Outputs: the plain op returns ``out``; the kernels return a tuple whose item 0 is
``out`` and item 1 the log-sum-exp, which the ring op also returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

aten = torch.ops.aten

# op -> names of its positional arguments, in order (keyword-only ones come as kwargs).
_SIGNATURES = {
    aten.scaled_dot_product_attention.default: (
        "query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa",
    ),
    aten._scaled_dot_product_flash_attention_for_cpu.default: (
        "query", "key", "value", "dropout_p", "is_causal",
    ),
    aten._scaled_dot_product_flash_attention.default: (
        "query", "key", "value", "dropout_p", "is_causal", "return_debug_mask",
    ),
    aten._scaled_dot_product_efficient_attention.default: (
        "query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal",
    ),
    aten._scaled_dot_product_cudnn_attention.default: (
        "query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal",
        "return_debug_mask",
    ),
}  # fmt: skip
ATTENTION_OPS = frozenset(_SIGNATURES)


@dataclass(frozen=True)
class Attention:
    node: fx.Node
    q: fx.Node
    k: fx.Node
    v: fx.Node
    mask: fx.Node | None
    dropout_p: float
    is_causal: bool
    scale: float | None
    returns_tuple: bool


def read_attention(node: fx.Node) -> Attention:
    names = _SIGNATURES[node.target]
    args = dict(zip(names, node.args, strict=False)) | dict(node.kwargs)
    mask = args.get("attn_mask", args.get("attn_bias"))
    return Attention(
        node=node,
        q=args["query"],
        k=args["key"],
        v=args["value"],
        mask=mask,
        dropout_p=float(args.get("dropout_p", 0.0)),
        is_causal=bool(args.get("is_causal", False)),
        scale=args.get("scale"),
        returns_tuple=node.target != aten.scaled_dot_product_attention.default,
    )


def find_attention(graph: fx.Graph) -> list[Attention]:
    return [
        read_attention(n)
        for n in graph.nodes
        if n.op == "call_function" and n.target in _SIGNATURES
    ]
