"""Attention in an ATen graph, found in any of its forms and read into one ``Attention``.

``aten.scaled_dot_product_attention`` is what models call; the lowered kernels
(flash, memory-efficient, cuDNN, CPU flash) appear when a graph was traced after
dispatch or a model calls them directly; the folds write attention by hand, with sinks or a
soft cap, as ``reference_attention`` and text-and-image attention as ``joint_attention``.
Outputs: the plain op returns ``out``; the kernels return a tuple whose item 0 is
``out`` and item 1 the log-sum-exp, which the ring op also returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from ringify.passes.graph.nodes import shape
from ringify.runtime.attention.reference import attention as reference_attention
from ringify.runtime.attention.reference import joint_attention

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
    # attention with sinks or a soft cap, read from a model's own spelling (handwritten.py)
    reference_attention: (
        "query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa",
        "sinks", "softcap",
    ),
}  # fmt: skip
ATTENTION_OPS = frozenset(_SIGNATURES)
_ONE_OUTPUT = frozenset({aten.scaled_dot_product_attention.default, reference_attention})


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
    sinks: fx.Node | None = None  # a logit per head in every row's softmax (gpt-oss)
    softcap: float = 0.0  # scores capped as cap * tanh(s / cap) (Gemma 2)


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
        returns_tuple=node.target not in _ONE_OUTPUT,
        sinks=args.get("sinks"),
        softcap=float(args.get("softcap", 0.0)),
    )


def read_joint_attention(node: fx.Node) -> Attention:
    """A ``joint_attention`` (``joints.py``) as an ``Attention`` over the key part as long as
    its queries (its self-attention part), else the longest."""
    q, keys, values, scale, *_ = node.args
    lengths = [shape(k)[2] for k in keys]
    i = lengths.index(shape(q)[2]) if shape(q)[2] in lengths else lengths.index(max(lengths))
    return Attention(node, q, keys[i], values[i], None, 0.0, False, scale, False)


def find_attention(graph: fx.Graph) -> list[Attention]:
    return [
        read_joint_attention(n) if n.target is joint_attention else read_attention(n)
        for n in graph.nodes
        if n.op == "call_function" and (n.target in _SIGNATURES or n.target is joint_attention)
    ]
