"""Products whose rows carry the sequence: ``mm``/``matmul``/``bmm``, ``baddbmm``, ``addmm``,
``einsum``.

The rows of ``x @ w`` are computed from the rows of ``x``: a sharded x gives a sharded
output, its weights used whole; so do the columns of a sharded w under a whole x. A ``w`` sharded along its columns (k transposed, when an
attention map is itself an output) is gathered whole on every rank, reported, so that
each rank computes its rows of the map from the whole keys: O(S) gathered, never S x S.
"""

from __future__ import annotations

import string

import torch

from ringify.passes.graph.crossings import PassState, Rule
from ringify.passes.graph.nodes import shape, val
from ringify.passes.graph.placement import Fallback, Placements
from ringify.passes.graph.report import GatherReason, InsertedGather
from ringify.passes.graph.vocabulary import MATMULS

aten = torch.ops.aten


def infer_matmul(node, place: Placements):
    return _product_rows(node, *node.args[:2], place)


def infer_baddbmm(node, place: Placements):
    """``bias + x @ w``: the product's rows, the bias sharded like them or lined up."""
    bias, x, w = node.args[:3]
    rows = _product_rows(node, x, w, place)
    if isinstance(rows, Fallback):
        return rows
    if not place.sharded(bias):
        return place.line_up(node, [bias], rows)
    aligned = place[bias].dim + val(node).dim() - len(shape(bias))
    return rows if place[bias].at(aligned) == rows else Fallback(GatherReason.MIXED_DIMS)


def _product_rows(node, x, w, place: Placements):
    """Rows of x times w: x's sequence rows give the output's. A w sharded along its
    columns (k transposed, for the rows of an attention map) is gathered whole, unless x is
    whole: then w's columns give the output's (Mamba's ``dt_proj.weight @ dt^T``)."""
    whole_w = place.sharded(w) and len(shape(w)) >= 2 and place[w].dim == len(shape(w)) - 1
    rows = place.sharded(x) and place[x].dim < len(shape(x)) - 1
    if rows and (whole_w or not place.sharded(w)):
        return place[x].at(place[x].dim + val(node).dim() - len(shape(x)))
    if whole_w and not place.sharded(x):  # W @ x^T: a whole W, columns of the sequence
        return place[w].at(val(node).dim() - 1)
    batch = len(shape(x)) == len(shape(w)) and place[x] == place[w]
    if batch and place.sharded(x) and place[x].dim < len(shape(x)) - 2:
        return place[x]  # both sharded on a batch dim (one token's expert copies): local
    return Fallback(GatherReason.PRODUCT)


def rewrite_product(node, out, state: PassState) -> None:
    """A sharded w is gathered (reported); replicated weights are used whole, and
    baddbmm's bias is sliced where it lines up with the rows."""
    w = node.args[2] if node.target is aten.baddbmm.default else node.args[1]
    x = node.args[1] if node.target is aten.baddbmm.default else node.args[0]
    if state.sharded(w) and state.place.get(w) == state.place.get(x) == out:
        return  # a batched product of two sharded operands: local
    if state.sharded(w) and state.sharded(x):
        node.replace_input_with(w, state.gather(w))
        state.gathers.append(
            InsertedGather(node.name, str(node.target), GatherReason.WHOLE_FACTOR, f"({w.name})")
        )
    if node.target is aten.baddbmm.default:
        state.fit_replicated_inputs(node, out, aligned=[node.args[0]])
    else:
        state.fit_replicated_inputs(node, None)


def infer_addmm(node, place: Placements):
    bias, x, w = node.args[:3]
    if place.sharded(x) and not place.sharded(w) and place[x].dim == 0:
        return place.line_up(node, [bias], place[x])
    return Fallback(GatherReason.PRODUCT)


def infer_einsum(node, place: Placements):
    """``einsum`` that keeps the sequence's letter in its output (a permute, such as an
    unpatchify's ``nhwpqc->nchpwq``, or a product over other letters): local. Every sharded
    operand holds the sequence at that letter alike; a replicated one holds it at size 1
    (a broadcast) or not at all."""
    operands = node.args[1]
    letters = _einsum_letters(node.args[0], [len(shape(x)) for x in operands])
    if letters is None:
        return Fallback(GatherReason.UNREADABLE)
    terms, out = letters
    sharded = {(terms[i][place[x].dim], place[x].at(0)) for i, x in enumerate(operands)
               if place.sharded(x)}  # fmt: skip
    if len(sharded) != 1:
        return Fallback(GatherReason.MIXED_DIMS)
    letter, seq = sharded.pop()
    if letter not in out:
        return Fallback(GatherReason.PRODUCT)
    for term, x in zip(terms, operands, strict=True):
        if term.count(letter) > 1 or (
            not place.sharded(x) and letter in term and shape(x)[term.index(letter)] != 1
        ):
            return Fallback(GatherReason.MISALIGNED)
    return seq.at(out.index(letter))


def _einsum_letters(equation: str, ndims: list[int]) -> tuple[list[str], str] | None:
    """Each operand's letters and the output's, an ellipsis spelled out as fresh letters
    (right-aligned, as it broadcasts); ``None`` if the equation does not fit the operands."""
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ndims):
        return None
    named = [len(t.replace("...", "")) for t in terms]
    width = max(
        (n - k for t, n, k in zip(terms, ndims, named, strict=True) if "..." in t), default=0
    )
    fresh = "".join(c for c in string.ascii_letters if c not in equation)[:width]
    terms = [
        t.replace("...", fresh[width - (n - k) :])
        for t, n, k in zip(terms, ndims, named, strict=True)
    ]
    if any(len(t) != n for t, n in zip(terms, ndims, strict=True)):
        return None
    if arrow:
        return terms, rhs.replace("...", fresh)
    once = [c for c in sorted(set("".join(terms)) - set(fresh)) if "".join(terms).count(c) == 1]
    return terms, fresh + "".join(once)


RULES = {
    **dict.fromkeys(
        MATMULS,
        Rule(infer_matmul, rewrite_product),
    ),
    # addmm's bias broadcasts against the output
    aten.addmm.default: Rule(
        infer_addmm, lambda n, out, s: s.fit_replicated_inputs(n, out, aligned=[n.args[0]])
    ),
    aten.baddbmm.default: Rule(infer_baddbmm, rewrite_product),
    aten.einsum.default: Rule(infer_einsum, lambda n, out, s: s.fit_replicated_inputs(n, None)),
}
