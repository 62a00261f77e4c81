"""Ring attention against ``F.scaled_dot_product_attention`` on the full sequence (tests, benchmarks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ringify.runtime import ring_attention, shard
from ringify.runtime.attention.spec import AttentionSpec
from ringify.runtime.masks.program import MaskProgram


def model_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` (B, H, S, D) with the same values laid out as a model's attention gets them,
    ``q.view(B, S, H, D).transpose(1, 2)``: a non-contiguous view."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def make_inputs(batch, heads, kv_heads, seq, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (
        torch.randn(batch, h, seq, dim, generator=g, dtype=torch.float64).to(dtype)
        for h in (heads, kv_heads, kv_heads, heads)
    )
    return q, k, v, dout


def ring_forward_backward(q, k, v, dout, layout, kwargs, tiles_per_chunk=None):
    """On every rank: shard, run ring attention forward and backward, return local results.

    With ``tiles_per_chunk`` the op is called directly with that tiling instead of
    the one ``ring_attention`` picks from the shard's length.
    """
    q, k, v, dout = (
        shard(t, 2, layout=layout).detach().clone().requires_grad_(t is not dout)
        for t in (q, k, v, dout)
    )
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.shape[-2] > 1:  # this rank's query rows, every key column
        kwargs = {**kwargs, "attn_mask": shard(mask, -2, layout=layout)}
    if tiles_per_chunk is None:
        out = ring_attention(q, k, v, layout=layout, **kwargs)
    else:
        import torch.distributed as dist

        scale = kwargs.get("scale", q.shape[-1] ** -0.5)
        name, full = dist.group.WORLD.group_name, q.shape[2] * dist.get_world_size()
        mask, is_causal = kwargs.get("attn_mask"), kwargs.get("is_causal", False)
        spec = AttentionSpec(name, scale, is_causal, layout, tiles_per_chunk=tiles_per_chunk)
        out, _ = torch.ops.ringify.ring_attention(q, k, v, mask, [], full, spec)
    out.backward(dout)
    return [t.detach() for t in (out, q.grad, k.grad, v.grad)]


def reference(q, k, v, dout, kwargs):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def document_causal_program(learned: bool = False) -> str:
    """HF's packed-sequence mask as a program: document ids equal (inputs 0 and 1: the
    ids along queries and along keys), key at or before query. ``learned``: an additive
    float mask instead, the visible keys biased by a per-key float input 2."""
    code = [
        ("eq.Tensor", ({"in": 0}, {"in": 1}), "bool"),
        ("le.Tensor", ({"pos": "k"}, {"pos": "q"}), "bool"),
        ("__and__.Tensor", ({"op": 0}, {"op": 1}), "bool"),
    ]
    roles = ("q", "k")
    if learned:
        code.append(("where.ScalarOther", ({"op": 2}, {"in": 2}, float("-inf")), "float64"))
        roles += ("k",)
    return MaskProgram(roles, tuple(code)).text()


def window_program(width: int) -> str:
    """A causal sliding window of ``width`` keys as a program: q - width < k <= q."""
    code = (
        ("sub.Tensor", ({"pos": "q"}, {"pos": "k"}), "int64"),
        ("ge.Scalar", ({"op": 0}, 0), "bool"),
        ("lt.Scalar", ({"op": 0}, width), "bool"),
        ("__and__.Tensor", ({"op": 1}, {"op": 2}), "bool"),
    )
    return MaskProgram((), code).text()


def document_inputs(lengths: list[int]) -> list[torch.Tensor]:
    """``document_causal_program``'s inputs for documents of ``lengths`` packed in order:
    the document of each position along queries (S, 1) and along keys (1, S)."""
    docs = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])
    return [docs.view(-1, 1), docs.view(1, -1)]
