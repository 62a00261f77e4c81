"""Attention written by hand, read as SDPA: ``softmax(q @ k^T * scale + mask) @ v``.

HF's ``eager`` path, nanoGPT's fallback, ``nn.MultiheadAttention`` with ``need_weights``
and most research code compute attention from its parts. ``fold_handwritten_attention``
runs on the exported graph before the pass and rewrites each such subgraph into one
``aten.scaled_dot_product_attention`` node with the same semantics, so that masks as
programs, GQA folding, the ring op and the report apply unchanged. Read as in Inductor's
``fx_passes/fuse_attention.py``, but from the softmax outwards, so that one reader covers
the spellings instead of one pattern each:

- the scores: ``matmul``/``bmm`` of q and k transposed on their last two dims
  (``baddbmm`` adds a mask and scales), 3-D (B*H, S, D) or 4-D;
- the scale: constants multiplying or dividing the scores, q or k below the mask;
- masks: ``+ mask`` (SDPA's float mask; ``baddbmm``'s, times its ``beta``), or
  ``masked_fill``/``where`` with -inf or the dtype's minimum (the additive mask
  ``where(hidden, fill, 0)``, which gives the same scores: x + min rounds to min for any
  |x| below 1e31); several are combined into one (BLOOM adds ALiBi and a causal mask);
- a soft cap, ``cap * tanh(s / cap)`` before the masks (Gemma 2), and a sink column
  concatenated to the scores and dropped after the softmax (gpt-oss), less the row's
  maximum (which changes no probability): read into ``runtime/attention/reference.py``'s
  ``attention``, which the ring op runs with ``softcap`` and ``sinks``;
- a view between (B*H, S, S) scores and (B, H, S, S) ones, and back (BLOOM);
- casts around the softmax, dropout (kept as SDPA's ``dropout_p``, which the ring
  refuses in training as for SDPA);
- the probabilities times v.

When the probabilities are also an output (``output_attentions``, ``need_weights``),
the product with v still becomes SDPA and the probabilities keep their own nodes: the
pass computes this rank's rows of them, against the whole keys (``rules.py``).
"""

from __future__ import annotations

import math

import torch
from torch import fx

from ringify.passes.folds.spellings import (
    capped,
    constant,
    einsum,
    factor,
    reaches_product,
    row_max_subtracted,
    scales,
    skip_casts,
    splits_heads,
    untransposed,
)
from ringify.passes.graph.nodes import call, erase_unused, shape, slice_bounds, uses, val
from ringify.passes.graph.vocabulary import (
    ANY_CAST,
    BATCHED_MATMULS,
    MASKED_FILLS,
    SIZED_VIEWS,
    SOFTMAXES,
    WHERES,
)
from ringify.runtime.attention.reference import attention as reference_attention

aten = torch.ops.aten
FORM_NOTE = "ringify_form"  # node.meta key of an SDPA node this pass wrote: how it was spelled
UNREAD_NOTE = "ringify_unread"  # node.meta key: why a softmax (or flex node) is not attention


class _NotAttention(Exception):
    """This softmax is not the middle of an attention; the message says why."""


def fold_handwritten_attention(gm: fx.GraphModule) -> int:
    """Rewrite every hand-written attention of ``gm`` into SDPA; how many."""
    graph = gm.graph
    folded = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in SOFTMAXES:
            continue
        try:
            _fold(graph, node)
            folded += 1
        except _NotAttention as e:
            node.meta[UNREAD_NOTE] = str(e)
    return folded


def _fold(graph: fx.Graph, softmax: fx.Node) -> fx.Node:
    if softmax.args[1] not in (-1, val(softmax).dim() - 1):
        raise _NotAttention("the softmax is not over the last dim")
    scores = _Scores(softmax.args[0])
    chain, dropout_p, product = _probabilities(softmax, scores)
    v, v_order, out_order = _v_of(product)
    operands = ((scores.q, scores.q_order), (scores.k, scores.k_order), (v, v_order))
    _check_operands(*(_laid_out(shape(x), order) for x, order in operands))
    if len({val(x).dtype for x, _ in operands}) != 1:
        raise _NotAttention("q, k and v have different dtypes")
    with graph.inserting_before(product):
        q, k, v = (_permuted(graph, x, order) for x, order in operands)
        mask = scores.sdpa_mask(graph)
        q4, k4, v4 = (scores.four_dims(graph, x) for x in (q, k, v))
        kwargs = {"attn_mask": mask, "dropout_p": dropout_p, "scale": scores.scale}
        if scores.sinks is None and not scores.softcap:
            attention = call(graph, aten.scaled_dot_product_attention.default, (q4, k4, v4), kwargs)
        else:
            kwargs |= {"sinks": scores.sinks, "softcap": scores.softcap}
            attention = call(graph, reference_attention, (q4, k4, v4), kwargs)
        out = scores.as_written(graph, attention, _laid_out(shape(product), _inverse(out_order)))
        out = _permuted(graph, out, out_order)
    escaped = any(u not in chain and u is not product for x in chain for u in uses(x))
    form = (
        "by hand"
        + ", with sinks" * (scores.sinks is not None)
        + ", soft-capped" * bool(scores.softcap)
    )
    attention.meta[FORM_NOTE] = form + ", probabilities an output" * escaped
    product.replace_all_uses_with(out)
    erase_unused(graph, product)
    return attention


class _Scores:
    """The chain from the product of q and k up to the softmax's input, read backwards."""

    def __init__(self, x: fx.Node):
        self.scale, self.masks = 1.0, []  # masks: ("add" | "hide" | "keep", node, fill)
        self.q_order = self.k_order = None  # an einsum's q and k dims in SDPA's order
        self.sinks, self.softcap = None, 0.0
        self.heads: list | None = None  # (B, H) where (B * H, S, S) scores are viewed 4-D
        while True:
            x = skip_casts(x)
            target = x.target
            if row_max_subtracted(x):  # softmax(s - max(s)) is softmax(s)
                x = x.args[0]
            elif target is aten.cat.default and self.sinks is None:
                x = self._sink(x)
            elif capped(x) is not None:
                if self.scale != 1.0:
                    raise _NotAttention("the scores are scaled after their soft cap")
                self.softcap, x = capped(x)
            elif scales(x):
                self.scale *= factor(x)
                x = x.args[0]
            elif target in SIZED_VIEWS and self.heads is None and splits_heads(x):
                self.heads = shape(x)[:2]
                x = x.args[0]
            elif target is aten.add.Tensor and all(isinstance(a, fx.Node) for a in x.args[:2]):
                side = 0 if reaches_product(x.args[0]) else 1
                self._mask("add", x.args[1 - side], None)
                x = x.args[side]
            elif target in MASKED_FILLS:
                self._mask("hide", x.args[1], _fill(x.args[2], x))
                x = x.args[0]
            elif target in WHERES:
                side = 1 if reaches_product(x.args[1]) else 2
                how = "keep" if side == 1 else "hide"
                self._mask(how, x.args[0], _fill(x.args[3 - side], x))
                x = x.args[side]
            elif target is aten.baddbmm.default:  # beta * mask + alpha * q @ k^T
                self._mask("add", x.args[0], float(x.kwargs.get("beta", 1)))
                self.scale *= float(x.kwargs.get("alpha", 1))
                self._read_product(x.args[1], x.args[2])
                break
            elif target in BATCHED_MATMULS:
                self._read_product(*x.args[:2])
                break
            elif (e := einsum(x)) is not None and e.scores:  # "bhid,bhjd->bhij", any order
                self.q, self.k = (self._unscaled(f) for f in x.args[1])
                self.q_order = e.order(e.a, e.batch + e.i + e.c)
                self.k_order = e.order(e.b, e.batch + e.j + e.c)
                break
            else:
                raise _NotAttention(f"the scores come from {target}, not a product of q and k")

    def _mask(self, how: str, mask: fx.Node, fill: float | None) -> None:
        """A mask, hiding (``fill`` -inf or the dtype's minimum) or added (``fill``: a
        factor, as baddbmm's ``beta``); noted whether it meets the scores below their view
        from (B * H, S, S) to (B, H, S, S), where it is 3-D as they are."""
        if self.scale != 1.0:  # (scores + mask) * c would scale the mask too
            raise _NotAttention("the scores are scaled after their mask is applied")
        if self.softcap:  # cap(scores + mask) caps the mask too
            raise _NotAttention("the scores are masked before their soft cap")
        self.masks.append((how, mask, fill, self.heads is not None))

    def _sink(self, cat: fx.Node) -> fx.Node:
        """``cat([scores, sink], -1)``: the scores; the sink, one logit per head, kept."""
        tensors, dim = cat.args[0], cat.args[1] if len(cat.args) > 1 else 0
        if len(tensors) != 2 or dim not in (-1, len(shape(cat)) - 1) or self.masks:
            raise _NotAttention("the scores are concatenated with more than a sink column")
        scores, column = tensors
        source = column.args[0] if column.target is aten.expand.default else column
        if shape(column)[-1] != 1 or len(shape(source)) != 4 or shape(source)[2:] != [1, 1]:
            raise _NotAttention("the column concatenated to the scores is not a logit per head")
        self.sinks = source
        return scores

    def _read_product(self, q: fx.Node, k_t: fx.Node) -> None:
        self.q = self._unscaled(q)
        k = untransposed(self._unscaled(k_t))
        if k is None:
            raise _NotAttention("the keys are not transposed on their last two dims")
        self.k = self._unscaled(k)

    def _unscaled(self, x: fx.Node) -> fx.Node:
        while scales(x):
            self.scale *= factor(x)
            x = x.args[0]
        return x

    def sdpa_mask(self, graph: fx.Graph) -> fx.Node | None:
        """The masks as one mask SDPA takes: added masks summed (in q's dtype, as SDPA adds
        a float mask), masks hiding with -inf as the bool mask of what is kept, masks hiding
        with the dtype's minimum as an added mask of that value; both kinds: the sum with
        -inf where nothing is kept."""
        added, kept = None, None
        dtype = val(self.q).dtype
        for how, mask, fill, below_view in self.masks:
            if below_view:
                mask = self.four_dims(graph, mask)
            if how == "add" or fill != -math.inf:
                part = self._added(graph, how, mask, fill, dtype)
                added = part if added is None else call(graph, aten.add.Tensor, (added, part))
            else:
                part = mask if how == "keep" else call(graph, aten.logical_not.default, (mask,))
                kept = part if kept is None else call(graph, aten.logical_and.default, (kept, part))
        if added is None or kept is None:
            return kept if added is None else added
        return call(graph, aten.where.ScalarOther, (kept, added, -math.inf))

    @staticmethod
    def _added(graph: fx.Graph, how: str, mask: fx.Node, fill, dtype) -> fx.Node:
        """An added mask in ``dtype`` (times its factor), or a hiding one as the value it adds."""
        if how == "add":  # (a bool or integer mask added to the scores adds its values)
            if val(mask).dtype != dtype:
                mask = call(graph, aten.to.dtype, (mask, dtype))
            return mask if fill in (None, 1.0) else call(graph, aten.mul.Tensor, (mask, fill))
        if how == "keep":
            mask = call(graph, aten.logical_not.default, (mask,))
        zeros = call(graph, aten.zeros_like.default, (mask,), {"dtype": dtype})
        return call(graph, aten.masked_fill.Scalar, (zeros, mask, fill))

    def four_dims(self, graph: fx.Graph, x: fx.Node | None) -> fx.Node | None:
        """A 3-D operand or mask as SDPA takes it: (B * H, ...) viewed (B, H, ...) where the
        scores were, else with a leading dim of 1; 4-D ones (and ``None``) as they are."""
        if x is None or val(x).dim() != 3:
            return x
        if self.heads is None:
            return call(graph, aten.unsqueeze.default, (x, 0))
        lead = self.heads if shape(x)[0] != 1 else [1, 1]
        return call(graph, aten.reshape.default, (x, [*lead, *shape(x)[1:]]))

    def as_written(self, graph: fx.Graph, attention: fx.Node, like: list) -> fx.Node:
        """SDPA's (B, H, S, D) result in the shape the model's product had."""
        if len(like) == 4:
            return attention
        if self.heads is None:
            return call(graph, aten.squeeze.dim, (attention, 0))
        return call(graph, aten.reshape.default, (attention, like))


def _probabilities(softmax: fx.Node, scores: _Scores) -> tuple[list[fx.Node], float, fx.Node]:
    """The nodes from the softmax to the probabilities v is multiplied by (through casts,
    dropout, the view back to 3-D where the scores were viewed 4-D, and the slice that drops
    a sink's column), dropout's probability, and that product."""
    chain, dropout_p, x = [softmax], 0.0, softmax
    sink_dropped = scores.sinks is None
    while True:
        products = [u for u in uses(x) if (_times(u) or (None,))[0] is x]
        if len(products) == 1 and sink_dropped:
            return chain, dropout_p, products[0]
        following = [u for u in uses(x) if u.args[0] is x]
        steps = [u for u in following if _passes_probabilities(u, scores, sink_dropped)]
        if len(products) > 1 or len(steps) != 1:
            raise _NotAttention("the probabilities are not multiplied by one v")
        x = steps[0]
        if x.target is aten.dropout.default and x.args[2]:
            dropout_p = float(x.args[1])
        sink_dropped |= x.target is aten.slice.Tensor
        chain.append(x)


def _passes_probabilities(node: fx.Node, scores: _Scores, sink_dropped: bool) -> bool:
    """Whether ``node`` carries the probabilities on towards v unchanged in value."""
    if node.target in ANY_CAST or node.target is aten.dropout.default:
        return True
    if node.target in SIZED_VIEWS:  # back to (B * H, S, S), as the scores were
        return scores.heads is not None and len(shape(node)) == 3
    if node.target is aten.slice.Tensor and not sink_dropped:  # probs[..., :-1]
        ndim, columns = len(shape(node.args[0])), shape(node.args[0])[-1]
        dim = node.args[1] % ndim
        return dim == ndim - 1 and slice_bounds(node, columns) == (0, columns - 1, 1)
    return False


def _check_operands(qs: list, ks: list, vs: list) -> None:
    """q (..., L, E), k (..., S, E) and v (..., S, Ev) with the same leading dims, as SDPA
    takes them (the product broadcasts; SDPA's kernels do not)."""
    if not (len(qs) == len(ks) == len(vs) and len(qs) in (3, 4)):
        raise _NotAttention("q, k and v are not all 3-D or all 4-D")
    if qs[:-2] != ks[:-2] or ks[:-1] != vs[:-1] or qs[-1] != ks[-1]:
        raise _NotAttention(f"q {qs}, k {ks} and v {vs} do not line up without broadcasting")


def _times(node: fx.Node) -> tuple | None:
    """``(probabilities, v)`` if ``node`` multiplies them (``matmul``, ``bmm``, or an einsum
    whose first operand is laid out (batch, i, j): "bhij,bhjd->bhid", v and the result in any
    order), else None."""
    if node.target in BATCHED_MATMULS:
        return tuple(node.args[:2])
    e = einsum(node)
    if e is None or e.order(e.a, e.batch + e.i + e.c) is not None:
        return None
    return tuple(node.args[1])


def _v_of(product: fx.Node) -> tuple:
    """``(v, v's dims in SDPA's order, the result's dims in the product's order)`` (orders:
    None where they are SDPA's already)."""
    v = _times(product)[1]
    e = einsum(product)
    if e is None:
        return v, None, None
    return v, e.order(e.b, e.batch + e.c + e.j), e.order(e.batch + e.i + e.j, e.out)


def _laid_out(sizes: list, order: list[int] | None) -> list:
    return list(sizes) if order is None else [sizes[d] for d in order]


def _inverse(order: list[int] | None) -> list[int] | None:
    return None if order is None else sorted(range(len(order)), key=order.__getitem__)


def _permuted(graph: fx.Graph, x: fx.Node, order: list[int] | None) -> fx.Node:
    return x if order is None else call(graph, aten.permute.default, (x, order))


def _fill(arg, node: fx.Node) -> float:
    """The value hidden scores get: -inf, or the dtype's minimum (below any score, it
    absorbs an added score exactly). Another value would change rows with nothing kept."""
    c = constant(arg)
    if c == -math.inf or (c is not None and c == torch.finfo(val(node).dtype).min):
        return c
    raise _NotAttention(f"hidden scores are filled with {arg}, not -inf or the dtype's minimum")
