"""Joint sequences: text and image tokens put end to end, attended together, split back.

SD3, Flux and CogVideoX build their attention's sequence as ``cat([text, image], dim)``
(queries, keys and values, or the hidden states a whole block runs on), and split its
output back at the same point. The image part is the long sequence the ring shards; the
text part is short and replicated. As one tensor, the joint sequence has no placement:
every split would gather it. So ``fold_joint_sequences`` carries a joint value as its
parts, before placement:

- an op that treats each position alone (pointwise ops, views and transposes that keep
  the joined dim, norms, linear layers and reductions over other dims, casts) runs on each
  part (``positionwise.py``); a full-length operand that is not joint is sliced to them;
- a ``slice``/``split`` at the parts' bounds is the parts; a ``slice_scatter`` of a part
  replaces it (CogVideoX's RoPE on the image tokens only);
- SDPA (not causal; no mask, a padding mask of the keys, or one ANDed with a mask of the
  queries, as Chroma's) of joint queries runs per query part, and over joint keys and
  values it is ``joint_attention`` of the key parts (``runtime/attention/reference.py``),
  which the rules run as the ring plus a local block (``joint_attention.py``);
- any other reader of a joint value gets it put back together (``cat``) where it reads it.

Only the ``cat``s whose joint value reaches an attention or is split back at its bounds are
carried (found on a copy of the graph first): other ``cat``s stay as they are.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from ringify.passes.folds.positionwise import Items, Joint, distributed
from ringify.passes.graph.attention_nodes import read_attention
from ringify.passes.graph.nodes import (
    ancestors,
    call,
    erase_unused,
    is_tensor,
    norm_dim,
    shape,
    slice_bounds,
    val,
)
from ringify.passes.graph.vocabulary import ANDS, ASSERTS, NARROWS, SPLITS_BY_SIZE
from ringify.runtime.attention.reference import joint_attention
from ringify.runtime.zero_grads import with_zero_grads

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default


@dataclass
class _Carried:
    """What carrying did: the seeds whose values reached an attention or were split back
    at their bounds, the nodes replaced, and per attention its parts with their queries."""

    reached: set = field(default_factory=set)
    handled: list = field(default_factory=list)
    attentions: list = field(default_factory=list)
    # seeds of joint values that met another joint value along an earlier dim in one op: a
    # join of features (Flux's RoPE of three axes, side by side), not of sequences
    features: set = field(default_factory=set)


def fold_joint_sequences(gm: fx.GraphModule) -> int:
    """Carry the joint sequences that reach an attention as their parts; how many ``cat``s."""
    joins = {n for n in gm.graph.nodes if _joins(n)}
    if not joins:
        return 0
    while True:  # a trial on a copy, until no join of features is left among the seeds
        trial = fx.Graph()
        copies: dict[fx.Node, fx.Node] = {}
        trial.graph_copy(gm.graph, copies)
        original = {copy: node for node, copy in copies.items()}
        tried = _carry(trial, {copies[n] for n in joins})
        features = {original[c] for c in tried.features}
        if not features:
            break
        joins -= features
    if not tried.reached:
        return 0
    carried = _carry(gm.graph, {original[c] for c in tried.reached})
    _keep_dropped_queries(gm.graph, carried)
    for node in reversed(carried.handled):  # SDPA is not dead code to fx (its dropout is random)
        erase_unused(gm.graph, node)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return len(tried.reached)


def _carry(graph: fx.Graph, seeds: set) -> _Carried:
    """Carry the joint values of ``seeds`` (``cat`` nodes) through ``graph``."""
    joints: dict[fx.Node, Joint | Items] = {}
    carried = _Carried()
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.cat.default and not any(a in joints for a in node.args[0]):
            if node in seeds:
                dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, len(shape(node)))
                joints[node] = Joint(dim, tuple(node.args[0]), frozenset({node}))
            continue
        if not any(a in joints for a in node.all_input_nodes):
            continue
        if node.target in ASSERTS and isinstance(joints.get(node.args[0]), Joint):
            # a dtype/device check holds for every part as for the whole: checked on one
            node.replace_input_with(node.args[0], joints[node.args[0]].parts[0])
            continue
        with graph.inserting_before(node):
            done = _fold(graph, node, joints, carried)
        if done is None:
            carried.features |= _features(node, joints)
            continue
        carried.handled.append(node)
        if isinstance(done, fx.Node):
            node.replace_all_uses_with(done)
        else:
            joints[node] = done
    handled = set(carried.handled)
    for node, joint in joints.items():
        if isinstance(joint, Joint):
            _put_back(graph, node, joint, handled)
    return carried


def _features(node: fx.Node, joints: dict) -> set:
    """Where joint values meet in ``node`` along different dims (aligned from the last, as
    they broadcast), the seeds of those joined along the later dims: a sequence is an earlier
    dim than the features beside it."""
    nd = len(shape(node)) if is_tensor(node) else 0
    dims = {
        a: j.dim + nd - len(shape(a))
        for a in node.all_input_nodes
        if isinstance(j := joints.get(a), Joint)
    }
    if len(set(dims.values())) < 2:
        return set()
    first = min(dims.values())
    return set().union(*(joints[a].seeds for a, d in dims.items() if d != first))


def _joins(node: fx.Node) -> bool:
    """A ``cat`` that may join sequences: of several tensors, along another dim than the last
    (which joins features: RoPE's halves)."""
    if node.op != "call_function" or node.target is not aten.cat.default:
        return False
    ndim = len(shape(node))
    dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, ndim)
    # (cat takes an empty 1-D tensor beside any: an empty cache's past)
    same = all(len(shape(t)) == ndim for t in node.args[0])
    # parts as long as the data decides (Mochi's valid text tokens of one row) stay joined
    fixed = all(isinstance(shape(t)[dim], int) for t in node.args[0] if len(shape(t)) == ndim)
    return len(node.args[0]) > 1 and dim < ndim - 1 and same and fixed


def _keep_dropped_queries(graph: fx.Graph, carried: _Carried) -> None:
    """A query part whose output the model drops (SD3's last block drops its text tokens)
    still gets its zero gradient, as from the unmodified SDPA: a part that is used passes
    through ``with_zero_grads`` of the dropped queries."""
    live = ancestors([graph.output_node()])
    for parts, queries in carried.attentions:
        used = [p for p in parts if p in live]
        dropped = [q for p, q in zip(parts, queries, strict=True) if p not in live]
        if not used or not dropped:
            continue
        users = list(used[0].users)
        with graph.inserting_after(used[0]):
            tied = call(graph, with_zero_grads, (used[0], dropped))
        for user in users:
            user.replace_input_with(used[0], tied)


def _fold(graph: fx.Graph, node: fx.Node, joints: dict, carried: _Carried):
    """``node`` on the parts of its joint inputs: a ``Joint``, ``Items``, a node that stands
    for it, or ``None`` (it reads the whole value)."""
    target, args = node.target, node.args
    if target is operator.getitem and isinstance(joints.get(args[0]), Items):
        return joints[args[0]].items[args[1]]
    first = joints.get(args[0]) if args else None
    if not isinstance(first, Joint) and target not in (aten.cat.default, _SDPA):
        return distributed(graph, node, joints)
    if target is aten.cat.default:
        return _cat(graph, node, joints)
    if target is _SDPA:
        return _attention(graph, node, joints, carried)
    along = target in NARROWS
    dim = norm_dim(args[1] if len(args) > 1 else 0, len(shape(args[0]))) if along else None
    if (along and dim == first.dim) or (target in SPLITS_BY_SIZE and _split_dim(node) == first.dim):
        if target is aten.slice.Tensor:
            start, end, step = slice_bounds(node, first.bounds()[-1])
            split = _slice(first, start, end) if step == 1 else None
        elif target is aten.narrow.default:
            split = _slice(first, args[2], args[2] + args[3])
        else:
            split = _split(node, first)
        if split is not None:  # split back where it was joined: worth carrying
            carried.reached.update(first.seeds)
        return split
    if target is aten.slice_scatter.default:
        return _slice_scatter(node, first, joints)
    return distributed(graph, node, joints)


def _split_dim(node: fx.Node) -> int:
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    return norm_dim(dim, len(shape(node.args[0])))


def _slice(joint: Joint, start: int, end: int):
    """The parts between ``start`` and ``end`` if both are part bounds."""
    bounds = joint.bounds()
    if start not in bounds or end not in bounds or start >= end:
        return None
    parts = joint.parts[bounds.index(start) : bounds.index(end)]
    return parts[0] if len(parts) == 1 else Joint(joint.dim, parts, joint.seeds)


def _split(node: fx.Node, joint: Joint):
    """A split along the joint dim whose pieces are each whole parts (their sizes read from
    its result)."""
    ends = [0, *itertools.accumulate(piece.shape[joint.dim] for piece in val(node))]
    items = tuple(_slice(joint, a, b) for a, b in itertools.pairwise(ends))
    return None if None in items else Items(items, joint.seeds)


def _slice_scatter(node: fx.Node, joint: Joint, joints: dict):
    """``slice_scatter(joint, src, dim, start, end)`` over whole parts: those parts replaced."""
    src, dim = node.args[1], norm_dim(node.args[2] if len(node.args) > 2 else 0, len(shape(node)))
    if dim != joint.dim:
        return None
    start, end, step = slice(*node.args[3:6], *[None, None, 1][len(node.args[3:6]) :]).indices(
        joint.bounds()[-1]
    )
    replaced = _slice(joint, start, end) if step == 1 else None
    if replaced is None:
        return None
    bounds = joint.bounds()
    a, b = bounds.index(start), bounds.index(end)
    incoming = joints.get(src)
    if b - a == 1:
        new = (src,)
    elif isinstance(incoming, Joint) and incoming.bounds() == [
        x - start for x in bounds[a : b + 1]
    ]:
        new = incoming.parts
    else:
        return None
    return Joint(joint.dim, (*joint.parts[:a], *new, *joint.parts[b:]), joint.seeds)


def _cat(graph: fx.Graph, node: fx.Node, joints: dict):
    """A ``cat`` along the joint dim adds parts; along another dim, it joins part by part."""
    tensors = node.args[0]
    dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, len(shape(node)))
    found = [joints.get(t) for t in tensors]
    seeds = frozenset().union(*(j.seeds for j in found if isinstance(j, Joint)))
    if any(isinstance(j, Joint) and j.dim == dim for j in found):
        parts = []
        for t, j in zip(tensors, found, strict=False):
            if isinstance(j, Joint) and j.dim == dim:
                parts.extend(j.parts)
            elif j is None and len(shape(t)) == len(shape(node)):
                parts.append(t)
            else:
                return None
        return Joint(dim, tuple(parts), seeds)
    return distributed(graph, node, joints)


def _attention(graph: fx.Graph, node: fx.Node, joints: dict, carried: _Carried):
    """SDPA, not causal, with no mask or one whose rows broadcast (a padding mask of the
    keys): per query part, over key parts (``joint_attention``), the mask's columns cut
    alike."""
    att = read_attention(node)
    if att.is_causal or att.dropout_p or att.sinks is not None or att.softcap:
        return None
    rows, mask = _rows_and_keys(att.mask)
    if mask is not None and (mask in joints or shape(mask)[-2] != 1 or _may_be_learned(mask)):
        return None
    if rows is not None and (rows in joints or shape(rows)[-2] not in (1, shape(att.q)[2])):
        return None
    if shape(att.k)[1] != shape(att.q)[1]:  # GQA's fewer K/V heads: left to the ring op
        return None
    q, k, v = (joints.get(x) for x in (att.q, att.k, att.v))
    if any(j is not None and (not isinstance(j, Joint) or j.dim != 2) for j in (q, k, v)):
        return None
    if (k is None) != (v is None) or (k is not None and k.bounds() != v.bounds()):
        return None
    if k is not None and (q is None or q.bounds() != k.bounds()):
        return None  # a joint sequence attends to itself (not a cache's past beside a step)
    queries = q.parts if q is not None else (att.q,)
    masks = None
    if mask is not None and k is not None:
        masks = [
            call(graph, aten.slice.Tensor, (mask, -1, start, end))
            for start, end in itertools.pairwise(k.bounds())
        ]
    outs = []
    bounds = q.bounds() if q is not None else [0, shape(att.q)[2]]
    for part, (start, end) in zip(queries, itertools.pairwise(bounds), strict=True):
        if k is not None:
            args = (part, k.parts, v.parts, att.scale, masks)
            out = call(graph, joint_attention, args)
        else:
            kwargs = {"attn_mask": mask, "scale": att.scale}
            out = call(graph, _SDPA, (part, att.k, att.v), kwargs)
        if rows is not None:  # a query the mask leaves no key: SDPA's zero row
            kept = (
                rows
                if shape(rows)[-2] == 1
                else call(graph, aten.slice.Tensor, (rows, -2, start, end))
            )
            out = call(graph, aten.where.ScalarOther, (kept, out, 0.0))
        outs.append(out)
    seeds = frozenset().union(*(j.seeds for j in (q, k, v) if j is not None))
    carried.reached.update(seeds)
    carried.attentions.append((outs, list(queries)))
    return Joint(2, tuple(outs), seeds) if q is not None else outs[0]


def _rows_and_keys(mask: fx.Node | None) -> tuple[fx.Node | None, fx.Node | None]:
    """A bool mask ``rows & keys`` of a query factor (..., S, 1) and a key factor (..., 1, S)
    (Chroma's token mask times itself) as ``(rows, keys)``: SDPA under it is SDPA under the
    keys' factor, with the rows ``rows`` leaves no key made zero, as SDPA makes a row with
    no key. Any other mask: ``(None, mask)``."""
    if mask is None or mask.target not in ANDS or val(mask).dtype != torch.bool:
        return None, mask
    factors = mask.args[:2]
    if not all(isinstance(f, fx.Node) and is_tensor(f) and len(shape(f)) >= 2 for f in factors):
        return None, mask
    for rows, keys in (factors, factors[::-1]):
        if shape(rows)[-1] == 1 and shape(keys)[-2] == 1:
            return rows, keys
    return None, mask


def _may_be_learned(mask: fx.Node) -> bool:
    """A float mask computed from a float input, parameter or buffer (its gradient would be
    owed: the joint op takes padding masks, which have none)."""
    if not val(mask).is_floating_point():
        return False
    return any(
        n.op in ("placeholder", "get_attr") and isinstance(val(n), torch.Tensor)
        and val(n).is_floating_point()
        for n in ancestors([mask])
    )  # fmt: skip


def _put_back(graph: fx.Graph, node: fx.Node, joint: Joint, handled: set) -> None:
    """Where readers take the whole joint value: one ``cat`` of its parts, in its place."""
    readers = [u for u in node.users if u not in handled]
    if not readers or (node.target is aten.cat.default and tuple(node.args[0]) == joint.parts):
        return
    with graph.inserting_after(node):
        whole = call(graph, aten.cat.default, (list(joint.parts), joint.dim))
    for user in readers:
        user.replace_input_with(node, whole)
