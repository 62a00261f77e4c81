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
- the mask, at most one: ``+ mask`` (SDPA's float mask), or ``masked_fill``/``where``
  with -inf or the dtype's minimum (the additive mask ``where(hidden, fill, 0)``, which
  gives the same scores: x + min rounds to min for any |x| below 1e31);
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

from ringify.passes.nodes import call, erase_unused, shape, uses, val

aten = torch.ops.aten
FORM_NOTE = "ringify_form"  # node.meta key of an SDPA node this pass wrote: how it was spelled
UNREAD_NOTE = "ringify_unread"  # node.meta key: why a softmax (or flex node) is not attention

_SOFTMAXES = frozenset({aten.softmax.int, aten._softmax.default, aten._safe_softmax.default})
_CASTS = frozenset({aten.to.dtype, aten._to_copy.default, aten.type_as.default})
_PRODUCTS = frozenset({aten.matmul.default, aten.bmm.default})
_WHERES = frozenset({aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf})


class _NotAttention(Exception):
    """This softmax is not the middle of an attention; the message says why."""


def fold_handwritten_attention(graph: fx.Graph) -> list[fx.Node]:
    """Rewrite every hand-written attention of ``graph`` into SDPA; the new SDPA nodes."""
    folded = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _SOFTMAXES:
            continue
        try:
            folded.append(_fold(graph, node))
        except _NotAttention as e:
            node.meta[UNREAD_NOTE] = str(e)
    return folded


def _fold(graph: fx.Graph, softmax: fx.Node) -> fx.Node:
    if softmax.args[1] not in (-1, val(softmax).dim() - 1):
        raise _NotAttention("the softmax is not over the last dim")
    scores = _Scores(softmax.args[0])
    chain, dropout_p, product = _probabilities(softmax)
    q, k, v = scores.q, scores.k, _times(product)[1]
    _check_operands(q, k, v)
    with graph.inserting_before(product):
        mask = scores.sdpa_mask(graph)
        q4, k4, v4, mask4 = (_four_dims(graph, x, val(q).dim()) for x in (q, k, v, mask))
        kwargs = {"attn_mask": mask4, "dropout_p": dropout_p, "scale": scores.scale}
        attention = call(graph, aten.scaled_dot_product_attention.default, (q4, k4, v4), kwargs)
        out = attention if val(q).dim() == 4 else call(graph, aten.squeeze.dim, (attention, 0))
    escaped = any(u not in chain and u is not product for x in chain for u in uses(x))
    attention.meta[FORM_NOTE] = "by hand, probabilities an output" if escaped else "by hand"
    product.replace_all_uses_with(out)
    erase_unused(graph, product)
    return attention


class _Scores:
    """The chain from the product of q and k up to the softmax's input, read backwards."""

    def __init__(self, x: fx.Node):
        self.scale, self.masks = 1.0, []  # masks: ("add" | "hide" | "keep", node, fill)
        while True:
            x = _skip_casts(x)
            target = x.target
            if _scales(x):
                self.scale *= _factor(x)
                x = x.args[0]
            elif target is aten.add.Tensor and all(isinstance(a, fx.Node) for a in x.args[:2]):
                side = 0 if _reaches_product(x.args[0]) else 1
                self._mask("add", x.args[1 - side], None)
                x = x.args[side]
            elif target in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
                self._mask("hide", x.args[1], _fill(x.args[2], x))
                x = x.args[0]
            elif target in _WHERES:
                side = 1 if _reaches_product(x.args[1]) else 2
                how = "keep" if side == 1 else "hide"
                self._mask(how, x.args[0], _fill(x.args[3 - side], x))
                x = x.args[side]
            elif target is aten.baddbmm.default:
                if x.kwargs.get("beta", 1) != 1:
                    raise _NotAttention("baddbmm scales its mask")
                self.scale *= float(x.kwargs.get("alpha", 1))
                self._mask("add", x.args[0], None)
                self._read_product(x.args[1], x.args[2])
                break
            elif target in _PRODUCTS:
                self._read_product(*x.args[:2])
                break
            elif _einsum(x) == "qk":  # einsum("bhid,bhjd->bhij", q, k): k not transposed
                self.q, self.k = (self._unscaled(f) for f in x.args[1])
                break
            else:
                raise _NotAttention(f"the scores come from {target}, not a product of q and k")
        if len(self.masks) > 1:
            raise _NotAttention("more than one mask is applied to the scores")

    def _mask(self, how: str, mask: fx.Node, fill: float | None) -> None:
        if self.scale != 1.0:  # (scores + mask) * c would scale the mask too
            raise _NotAttention("the scores are scaled after their mask is applied")
        self.masks.append((how, mask, fill))

    def _read_product(self, q: fx.Node, k_t: fx.Node) -> None:
        self.q = self._unscaled(q)
        k = _untransposed(self._unscaled(k_t))
        if k is None:
            raise _NotAttention("the keys are not transposed on their last two dims")
        self.k = self._unscaled(k)

    def _unscaled(self, x: fx.Node) -> fx.Node:
        while _scales(x):
            self.scale *= _factor(x)
            x = x.args[0]
        return x

    def sdpa_mask(self, graph: fx.Graph) -> fx.Node | None:
        """The mask as SDPA takes it: an added mask as it is; hidden by -inf, the bool mask
        of what is kept; hidden by the dtype's minimum, the additive mask of that value."""
        if not self.masks:
            return None
        how, mask, fill = self.masks[0]
        dtype = val(self.q).dtype  # SDPA adds a float mask of q's dtype
        if how == "add":  # (a bool or integer mask added to the scores adds its values)
            same = val(mask).dtype == dtype
            return mask if same else call(graph, aten.to.dtype, (mask, dtype))
        if fill == -math.inf:
            return mask if how == "keep" else call(graph, aten.logical_not.default, (mask,))
        if how == "keep":
            mask = call(graph, aten.logical_not.default, (mask,))
        zeros = call(graph, aten.zeros_like.default, (mask,), {"dtype": dtype})
        return call(graph, aten.masked_fill.Scalar, (zeros, mask, fill))


def _probabilities(softmax: fx.Node) -> tuple[list[fx.Node], float, fx.Node]:
    """The nodes from the softmax to the probabilities v is multiplied by, dropout's
    probability, and that product."""
    chain, dropout_p, x = [softmax], 0.0, softmax
    while True:
        products = [u for u in uses(x) if (_times(u) or (None,))[0] is x]
        if len(products) == 1:
            return chain, dropout_p, products[0]
        following = [u for u in uses(x) if u.args[0] is x]
        steps = [u for u in following if u.target in _CASTS or u.target is aten.dropout.default]
        if len(products) > 1 or len(steps) != 1:
            raise _NotAttention("the probabilities are not multiplied by one v")
        x = steps[0]
        if x.target is aten.dropout.default and x.args[2]:
            dropout_p = float(x.args[1])
        chain.append(x)


def _check_operands(q: fx.Node, k: fx.Node, v: fx.Node) -> None:
    """q (..., L, E), k (..., S, E) and v (..., S, Ev) with the same leading dims and dtype,
    as SDPA takes them (the product broadcasts; SDPA's kernels do not)."""
    qs, ks, vs = (shape(x) for x in (q, k, v))
    if not (len(qs) == len(ks) == len(vs) and len(qs) in (3, 4)):
        raise _NotAttention("q, k and v are not all 3-D or all 4-D")
    if qs[:-2] != ks[:-2] or ks[:-1] != vs[:-1] or qs[-1] != ks[-1]:
        raise _NotAttention(f"q {qs}, k {ks} and v {vs} do not line up without broadcasting")
    if len({val(x).dtype for x in (q, k, v)}) != 1:
        raise _NotAttention("q, k and v have different dtypes")


def _times(node: fx.Node) -> tuple | None:
    """``(probabilities, v)`` if ``node`` multiplies them (``matmul``, ``bmm``, or an einsum
    of the form "bhij,bhjd->bhid"), else None."""
    if node.target in _PRODUCTS:
        return tuple(node.args[:2])
    return tuple(node.args[1]) if _einsum(node) == "pv" else None


def _einsum(node: fx.Node) -> str | None:
    """ "qk" for an einsum of q (..., i, d) and k (..., j, d) into (..., i, j); "pv" for one
    of p (..., i, j) and v (..., j, d) into (..., i, d); the batch letters the same, in the
    same order, one or two of them. Else None."""
    if node.target is not aten.einsum.default or len(node.args[1]) != 2:
        return None
    equation = node.args[0].replace(" ", "")
    if "." in equation or equation.count("->") != 1 or equation.count(",") != 1:
        return None
    inputs, out = equation.split("->")
    a, b = inputs.split(",")
    batch = out[:-2]
    if len(batch) not in (1, 2) or not (a[:-2] == b[:-2] == batch) or len(a) != len(out):
        return None
    (a1, a2), (b1, b2), (o1, o2) = a[-2:], b[-2:], out[-2:]
    if len({*batch, a1, a2, b1, b2, o1, o2}) != len(batch) + 3:
        return None  # three distinct letters besides the batch's
    if a2 == b2 and (o1, o2) == (a1, b1):
        return "qk"
    if a2 == b1 and (o1, o2) == (a1, b2):
        return "pv"
    return None


def _four_dims(graph: fx.Graph, x: fx.Node | None, ndim: int) -> fx.Node | None:
    """3-D attention operands (and masks of that rank) with a leading dim of 1."""
    if x is None or ndim == 4 or val(x).dim() < 3:
        return x
    return call(graph, aten.unsqueeze.default, (x, 0))


def _skip_casts(x: fx.Node) -> fx.Node:
    while isinstance(x, fx.Node) and x.target in _CASTS:
        x = x.args[0]
    return x


def _scales(x: fx.Node) -> bool:
    return x.target in (aten.mul.Tensor, aten.div.Tensor) and _constant(x.args[1]) is not None


def _factor(x: fx.Node) -> float:
    c = _constant(x.args[1])
    return c if x.target is aten.mul.Tensor else 1.0 / c


def _constant(arg) -> float | None:
    """A Python number, or a node filled with one (``scalar_tensor``, ``full``)."""
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return float(arg)
    if isinstance(arg, fx.Node) and arg.target is aten.scalar_tensor.default:
        return float(arg.args[0])
    if isinstance(arg, fx.Node) and arg.target is aten.full.default and not arg.args[0]:
        return float(arg.args[1])
    return None


def _fill(arg, node: fx.Node) -> float:
    """The value hidden scores get: -inf, or the dtype's minimum (below any score, it
    absorbs an added score exactly). Another value would change rows with nothing kept."""
    c = _constant(arg)
    if c == -math.inf or (c is not None and c == torch.finfo(val(node).dtype).min):
        return c
    raise _NotAttention(f"hidden scores are filled with {arg}, not -inf or the dtype's minimum")


def _reaches_product(x, depth: int = 8) -> bool:
    """Whether ``x`` is computed from a product of q and k (the scores' side of an add)."""
    for _ in range(depth):
        if not isinstance(x, fx.Node) or x.op != "call_function":
            return False
        if x.target in _PRODUCTS or x.target is aten.baddbmm.default or _einsum(x) == "qk":
            return True
        x = x.args[1] if x.target in _WHERES else x.args[0]
    return False


def _untransposed(x: fx.Node) -> fx.Node | None:
    """``k`` if ``x`` is ``k`` with its last two dims swapped, else None."""
    ndim = val(x).dim()
    last = {ndim - 2, ndim - 1}
    if x.target is aten.transpose.int and {a % ndim for a in x.args[1:3]} == last:
        return x.args[0]
    if x.target is aten.permute.default:
        dims = [d % ndim for d in x.args[1]]
        if dims == [*range(ndim - 2), ndim - 1, ndim - 2]:
            return x.args[0]
    return None
