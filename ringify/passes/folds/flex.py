"""FlexAttention read as SDPA with its ``mask_mod`` as a mask over position vectors.

``flex_attention(q, k, v, block_mask=create_block_mask(mask_mod, ...))`` exports as a
``torch.ops.higher_order.flex_attention`` node holding the ``mask_mod`` as a graph of
``(b, h, q_idx, kv_idx, *tensors it closes over)``, and the ``BlockMask``'s tensors,
computed for the full sequence by the graph before it. ``fold_flex_attention`` rewrites
each node, before the plan, into ``aten.scaled_dot_product_attention`` whose bool mask is
the ``mask_mod``'s graph applied to broadcast position vectors (``b`` as (B,1,1,1), ``h``
as (1,H,1,1), ``q_idx`` as (1,1,L,1), ``kv_idx`` as (1,1,1,S)): exactly what HF builds for
SDPA, so the mask becomes a program (``mask_programs.py``) evaluated tile by tile, never
an S x S tensor; the ``BlockMask``'s computation dies with the node.

Supported: any ``mask_mod`` of elementwise ops and lookups in the tensors it closes over
(causal, sliding windows, documents, prefixes), GQA, a scale, and a ``score_mod`` that
adds a bias of the positions to the score (ALiBi, a relative-position table, learned or
not: the bias joins the mask as SDPA's float mask, a learned program), and the
log-sum-exp used only to rescale the output by a sink logit per head, ``out *
sigmoid(lse - sinks)`` (torchtitan's gpt-oss: the softmax with a sink column, dropped),
read as attention with ``sinks``. Another ``score_mod`` (a soft cap) and any other use of
the log-sum-exp are refused with the reason.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
from torch import fx

from ringify.passes.folds.handwritten import FORM_NOTE, UNREAD_NOTE
from ringify.passes.graph.nodes import call, erase_unused, shape, uses, val
from ringify.passes.graph.vocabulary import ASSERTS, RESCALE_PASSING
from ringify.runtime.attention.reference import attention as reference_attention

aten = torch.ops.aten
FLEX = torch.ops.higher_order.flex_attention


class NotFoldable(Exception):
    """The flex attention cannot become SDPA; the message says why."""


def fold_flex_attention(gm: fx.GraphModule) -> int:
    """Rewrite every FlexAttention node of ``gm`` as above; how many."""
    folded = 0
    for node in [n for n in gm.graph.nodes if n.target is FLEX]:
        try:
            _fold(gm, node)
            folded += 1
        except NotFoldable as e:
            node.meta[UNREAD_NOTE] = str(e)
    return folded


def _fold(gm: fx.GraphModule, node: fx.Node) -> None:
    q, k, v, score_mod, block_mask, scale, _, score_tensors, mask_tensors = node.args[:9]
    outputs = {u.args[1]: u for u in node.users if uses(u)}
    rescale = None
    if set(outputs) - {0}:
        rescale = _sink_rescale(outputs, shape(q)[1])
        if rescale is None:
            raise NotFoldable("its log-sum-exp is used (other than to rescale by sinks)")
    graph = gm.graph
    b, h, length, _ = shape(q)
    with graph.inserting_before(node):
        positions = [
            _positions(graph, q, size, dim) for dim, size in enumerate((b, h, length, shape(k)[2]))
        ]
        mask = _inline(gm, getattr(gm, block_mask[-1].target), [*positions, *mask_tensors])
        bias = _added(gm, getattr(gm, score_mod.target), [*positions, *score_tensors])
        if bias is not None:  # the kept scores get the bias; hidden ones -inf
            bias = call(graph, aten.to.dtype, (bias, val(q).dtype))
            mask = call(graph, aten.where.ScalarOther, (mask, bias, float("-inf")))
        kwargs = {"attn_mask": mask, "scale": scale, "enable_gqa": shape(k)[1] != h}
        if rescale is None:
            attention = call(graph, aten.scaled_dot_product_attention.default, (q, k, v), kwargs)
        else:
            # a logit per head, as the ring op takes it: (1, H, 1, 1)
            kwargs["sinks"] = call(graph, aten.view.default, (rescale.sinks, [1, -1, 1, 1]))
            attention = call(graph, reference_attention, (q, k, v), kwargs)
    attention.meta[FORM_NOTE] = "flex_attention" + ", with sinks" * (rescale is not None)
    if rescale is not None:  # the product is the rescaled output: the attention's own now
        product, scaled = rescale.product, rescale.out
        if val(scaled).dtype != val(product).dtype:
            with graph.inserting_before(product):
                scaled = call(graph, aten.to.dtype, (scaled, val(product).dtype))
        product.replace_all_uses_with(scaled)
        erase_unused(graph, product)
    for user in list(node.users):
        if user.args[1] == 0:
            user.replace_all_uses_with(attention)
        erase_unused(graph, user)  # the last one takes the node, and the BlockMask's work
    for part in block_mask:
        if isinstance(part, fx.Node):
            erase_unused(graph, part)


@dataclasses.dataclass
class _Rescale:
    sinks: fx.Node  # the (heads,) sink logits
    product: fx.Node  # out * sigmoid(lse - sinks)
    out: fx.Node  # the output as the product reads it


def _passed(x: fx.Node) -> tuple[list[fx.Node], fx.Node | None]:
    """The nodes ``x`` passes through (only user after only user, each in ``RESCALE_PASSING``) and
    the first user that is not one (``None`` where there are several)."""
    chain = []
    while True:
        users = [u for u in x.users if u.target not in ASSERTS]
        if len(users) != 1:
            return chain, None
        if users[0].target not in RESCALE_PASSING or users[0].args[0] is not x:
            return chain, users[0]
        x = users[0]
        chain.append(x)


def _sink_rescale(outputs: dict, heads: int) -> _Rescale | None:
    """``out * sigmoid(lse - sinks)`` in torchtitan's layout: out and lse transposed alike to
    (B, L, H, ...) and (B, L, H), ``sinks`` a (H,) vector viewed along the last dim."""
    if set(outputs) != {0, 1}:
        return None
    # the node's log-sum-exp is in base 2: flex_attention returns it times ln 2
    natural = [u for u in outputs[1].users if u.target not in ASSERTS]
    if len(natural) != 1 or natural[0].target is not aten.mul.Tensor:
        return None
    if natural[0].args[0] is not outputs[1] or natural[0].args[1] != math.log(2):
        return None
    lse_chain, sub = _passed(natural[0])
    out_chain, product = _passed(outputs[0])
    moved = [x.target for x in lse_chain]
    if moved != [aten.transpose.int] or [x.target for x in out_chain] != moved:
        return None
    if sorted(a % 3 for a in lse_chain[0].args[1:]) != [1, 2] or sorted(
        a % 4 for a in out_chain[0].args[1:]
    ) != [1, 2]:
        return None  # (B, H, L) to (B, L, H): heads last
    if sub is None or sub.target is not aten.sub.Tensor or sub.args[0] is not lse_chain[-1]:
        return None
    sinks = sub.args[1]
    while isinstance(sinks, fx.Node) and sinks.target in RESCALE_PASSING and len(shape(sinks)) > 1:
        sinks = sinks.args[0]
    viewed = shape(sub.args[1]) if isinstance(sub.args[1], fx.Node) else None
    if not isinstance(sinks, fx.Node) or shape(sinks) != [heads] or viewed != [1, 1, heads]:
        return None
    _, sigmoid = _passed(sub)
    if sigmoid is None or sigmoid.target is not aten.sigmoid.default:
        return None
    scale_chain, found = _passed(sigmoid)
    if found is not product or product is None or product.target is not aten.mul.Tensor:
        return None
    if aten.unsqueeze.default not in {x.target for x in scale_chain}:
        return None
    scale, out = (scale_chain[-1], out_chain[-1])
    if set(product.args) != {scale, out}:
        return None
    return _Rescale(sinks, product, out)


def _added(gm: fx.GraphModule, score_mod: fx.GraphModule, inputs: list) -> fx.Node | None:
    """What ``score_mod`` adds to the score, inlined on ``inputs`` (positions, then the
    tensors it closes over); None for the identity. A score_mod that is not ``score +
    bias(b, h, q_idx, kv_idx)`` (a soft cap, a product) has no SDPA form: refused."""
    score = next(n for n in score_mod.graph.nodes if n.op == "placeholder")
    result = next(n for n in score_mod.graph.nodes if n.op == "output").args[0]
    if result is score:
        return None
    if result.target is not aten.add.Tensor or score not in result.args[:2]:
        raise NotFoldable("a score_mod other than score + a bias of the positions")
    bias = result.args[1] if result.args[0] is score else result.args[0]
    if not isinstance(bias, fx.Node) or _reads(bias, score):
        raise NotFoldable("a score_mod whose bias reads the score")
    return _inline(gm, score_mod, [None, *inputs], bias)


def _reads(x: fx.Node, y: fx.Node) -> bool:
    """Whether ``x`` is computed from ``y``."""
    seen, pending = set(), [x]
    while pending:
        n = pending.pop()
        if n is y:
            return True
        if n not in seen:
            seen.add(n)
            pending.extend(n.all_input_nodes)
    return False


def _positions(graph: fx.Graph, like: fx.Node, size: int, dim: int) -> fx.Node:
    """``arange(size)`` along ``dim`` of four, on ``like``'s device."""
    positions = call(graph, aten.arange.default, (size,), {"device": val(like).device}, like=like)
    view = [1, 1, 1, 1]
    view[dim] = size
    return call(graph, aten.view.default, (positions, view))


def _inline(gm: fx.GraphModule, mod: fx.GraphModule, inputs: list, result=None) -> fx.Node:
    """``mod``'s graph copied into ``gm``'s at the insertion point, on ``inputs`` (one per
    placeholder); what it outputs, or its node ``result``."""
    env: dict[fx.Node, object] = {}
    placeholders = iter(inputs)
    for n in mod.graph.nodes:
        if n.op == "placeholder":
            env[n] = next(placeholders)
        elif n.op == "get_attr":
            continue  # the indexing's function spec, read by flat_apply below
        elif n.op == "output":
            return env[n.args[0] if result is None else result]
        elif result is not None and not _reads(result, n):
            continue  # not on the way to ``result`` (the score's own ops)
        elif n.target is torch.ops.higher_order.flat_apply and str(n.args[2]).endswith("ModIndex"):
            x, *indices = (env[a] for a in n.args[3:])
            env[n] = call(gm.graph, aten.index.Tensor, (x, indices))
        elif isinstance(n.target, torch._ops.OpOverload) or n.target is operator.getitem:
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
            env[n] = call(gm.graph, n.target, args, kwargs)
        else:
            raise NotFoldable(
                f"its mask_mod or score_mod calls {n.target}, which ringify cannot read"
            )
    raise NotFoldable("its mask_mod returns nothing")
