"""The plan of one traced graph: which inputs carry the sequence, and how it is split.

Sequence inputs are found structurally: each dim of each input is tried alone,
and it is a sequence dim if, sharded, the rules (``rules.py``) carry it to the
sequence dim of some attention's q, or of the k or v of a self-attention (k as
long as q; a cross-attention's memory stays replicated). Sizes are never matched.
Where no input carries the sequence to an attention (a ViT's patches, audio
frames after a conv, a cls token concatenated in front), the sequence is *born*
inside the graph: the first node, in graph order, whose output carries it to that
attention is a seed as well (there, sizes name the candidates; the rules decide).
Each rank computes the graph up to the birth whole and keeps its own positions.
Companion inputs (labels) never reach attention but meet the sharded sequence;
they are found by following each replicated tensor that lines up with the
sequence back to an input. The geometry decides the padding: a length the ring
cannot split is padded at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from ringify.config import Config
from ringify.passes.folds.handwritten import UNREAD_NOTE
from ringify.passes.graph.attention_nodes import find_attention
from ringify.passes.graph.nodes import ancestors, is_tensor, shape, val
from ringify.passes.graph.placement import Seq, SequenceGeometry, view_placement
from ringify.passes.graph.vocabulary import CASTS_LIKE, KEEPS_POSITIONS, SAME_SHAPE, VIEWS
from ringify.passes.sharding.positions import positions_held
from ringify.passes.sharding.rules import infer_placements
from ringify.runtime.collectives.layout import padded_length, split_multiple
from ringify.runtime.masks.program import parse, program_mask


@dataclass(frozen=True)
class Plan:
    seeds: dict[fx.Node, Seq]  # the sequence inputs and births, and where their sequence is
    geometry: SequenceGeometry
    # inputs passed sharded that only build attention masks (a padding mask): gathered on
    # entry, O(S) each, so that the (S, S) mask they build is never gathered
    gathered: dict[fx.Node, Seq] = field(default_factory=dict)

    @property
    def births(self) -> list[fx.Node]:
        """The nodes where the sequence is born inside the graph (not an input)."""
        return [n for n in self.seeds if n.op != "placeholder"]


def sharded_input_dims(gm: fx.GraphModule, config: Config) -> tuple[dict[int, int], dict[int, int]]:
    """The inputs of ``inputs="sharded"`` mode that are this rank's part, found on a trace at
    the local shapes: (input index -> sequence dim) of the sequence inputs and of those
    (labels) that meet the sequence without reaching attention; and of those that build
    only attention masks (a padding mask passed sharded)."""
    seeds = _sequence_sources(gm.graph, config)
    node, seq = next(iter(seeds.items()))
    length = shape(node)[seq.dim]  # this trace's (local) sequence length
    geometry = SequenceGeometry(length, length, config.ring_size, config.layout)
    seeds |= _companion_inputs(gm.graph, seeds, geometry)
    masks = _mask_inputs(gm.graph, seeds, geometry)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]

    def dims(found: dict[fx.Node, Seq]) -> dict[int, int]:
        return {
            placeholders.index(n): s.dim
            for n, s in found.items()
            if n.op == "placeholder" and (s.inner, s.unit) == (1, 1)
        }

    return dims(seeds), dims(masks)


def plan_sequence(
    gm: fx.GraphModule,
    config: Config,
    dims: dict[int, int] | None = None,
    gathered: dict[int, int] | None = None,
    general: bool = False,
) -> Plan:
    """The plan for ``gm``, traced at global shapes; ``dims`` and ``gathered`` (input index ->
    sequence dim) when the sharded inputs were found already (on the trace at local shapes)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if dims is None:
        seeds = _sequence_sources(gm.graph, config)
    else:
        seeds = {placeholders[i]: Seq(d) for i, d in dims.items()}
        seeds |= _births(gm.graph, config, seeds, _targets(gm.graph, config))
    masks = {placeholders[i]: Seq(d) for i, d in (gathered or {}).items()}
    return Plan(seeds, _geometry(gm.graph, config, general), masks)


def _targets(graph: fx.Graph, config: Config) -> list[fx.Node]:
    """The tensors whose dim 2 the sequence must reach: every attention's q, and the k and
    v of self-attentions."""
    attentions = find_attention(graph)
    if not attentions and _reads_as_attention_free(graph):
        return []  # a scan's model (Mamba): the sequence is its token input's (``_tokens``)
    if not attentions:
        raise ValueError(_no_attention(graph))
    _check_attention_shapes(attentions, config)
    length = _sequence_length(attentions)
    attentions = [a for a in attentions if len(shape(a.q)) == 4 and _sized(a.q) == length]
    self_attention = [a for a in attentions if _sized(a.k) == length]
    return [a.q for a in attentions] + [x for a in self_attention for x in (a.k, a.v)]


def _reads_as_attention_free(graph: fx.Graph) -> bool:
    """No attention, and no softmax or FlexAttention call that was not read as one (those
    get ``_no_attention``'s error) but a token input to follow: a model that mixes its
    sequence another way (a state-space model such as Mamba)."""
    unread = any(
        UNREAD_NOTE in n.meta or n.target is torch.ops.higher_order.flex_attention
        for n in graph.nodes
    )
    return not unread and _tokens(graph) is not None


def _tokens(graph: fx.Graph) -> tuple[fx.Node, Seq] | None:
    """The sequence of a model without attention: dim 1 of its first (batch, sequence)
    token-id input, else of its first (batch, sequence, features) float input."""
    inputs = [n for n in graph.nodes if n.op == "placeholder" and is_tensor(n)]
    ids = [n for n in inputs if len(shape(n)) == 2 and not val(n).is_floating_point()]
    embeds = [n for n in inputs if len(shape(n)) == 3 and val(n).is_floating_point()]
    found = next(
        (n for n in ids + embeds if isinstance(shape(n)[1], int) and shape(n)[1] > 1), None
    )
    return None if found is None else (found, Seq(1))


def _no_attention(graph: fx.Graph) -> str:
    """What to tell a user whose graph has no attention: why each softmax was not read as
    one, and the one-line fixes; or, with no softmax at all, that ringify is for attention."""
    flex = [
        f"{n.name} ({n.meta.get(UNREAD_NOTE, '')})"
        for n in graph.nodes
        if n.target is torch.ops.higher_order.flex_attention
    ]
    if flex:
        return (
            f"the model computes attention with FlexAttention that ringify cannot read: "
            f"{'; '.join(flex)}. One-line fixes: for an HF model with an SDPA path (its "
            'class\'s _supports_sdpa), attn_implementation="sdpa" in from_pretrained or its '
            "config; otherwise (or for a model without one), call "
            "F.scaled_dot_product_attention (is_causal=True, or the mask_mod's mask as a tensor "
            "built from positions, which ringify reads as a program)."
        )
    unread = [f"{n.name}: {n.meta[UNREAD_NOTE]}" for n in graph.nodes if UNREAD_NOTE in n.meta]
    if not unread:
        return (
            "ringify found no attention in the model's graph, no softmax, and no token input "
            "to follow: it finds the sequence from a model's attention, or, in a model without "
            "one (a state-space model such as Mamba), from dim 1 of its (batch, sequence) "
            "token ids or (batch, sequence, features) embeddings. Pass the sequence that way, "
            "or run the model without ringify."
        )
    return (
        "ringify found no attention in the model's graph. It reads "
        "F.scaled_dot_product_attention, and attention written by hand as "
        "softmax(q @ k^T * scale + mask) @ v; these softmaxes were not read as attention: "
        + "; ".join(unread)
        + ". One-line fixes: for an HF model with an SDPA path (its class's _supports_sdpa), "
        'attn_implementation="sdpa" in from_pretrained or its config; for '
        "nn.MultiheadAttention, need_weights=False; otherwise (an HF model without one "
        "included), call F.scaled_dot_product_attention, or write the scores as ringify reads "
        "them: scaled before masking, hidden with -inf or torch.finfo(dtype).min, capped as "
        "tanh(s / c) * c, a sink logit as one column concatenated and dropped after the "
        "softmax, a bias added or through baddbmm."
    )


def _sequence_length(attentions: list) -> int:
    """The sequence the ring splits: the longest any attention's queries see. Attentions
    over a sequence of another length (a short decoder beside a long encoder), or of one the
    data decides (Mochi's valid text tokens beside the image's), run whole."""
    lengths = [_sized(a.q) for a in attentions if len(shape(a.q)) == 4]
    if not any(lengths):
        raise ValueError(
            "the length of every attention's sequence depends on the data (tokens picked by "
            "a mask, say): ringify splits sequences of a length known when the model is "
            "traced. Pad to a fixed length and mask the padding instead"
        )
    return max(lengths)


def _sized(x: fx.Node) -> int:
    """The sequence length (dim -2) of attention input ``x``; 0 where the data decides it."""
    length = shape(x)[-2]
    return length if isinstance(length, int) else 0


def _sequence_sources(graph: fx.Graph, config: Config) -> dict[fx.Node, Seq]:
    """The inputs whose sequence reaches attention, and the births of the others."""
    reached = _targets(graph, config)
    if not reached:
        return dict([_tokens(graph)])
    seeds: dict[fx.Node, Seq] = {}
    for node in graph.nodes:
        if node.op != "placeholder" or not is_tensor(node):
            continue
        for dim, size in enumerate(shape(node)):
            if not isinstance(size, int) or size < 2:
                continue
            geometry = SequenceGeometry(size, size, config.ring_size, config.layout)
            place = infer_placements(graph, geometry, {node: Seq(dim)}).place
            if any(place[x] == Seq(2) for x in reached):
                seeds[node] = Seq(dim)
                break
    seeds |= _births(graph, config, seeds, reached)
    if not seeds:
        unsized = [a.node.name for a in find_attention(graph) if not _sized(a.q)]
        raise ValueError(
            "no input of the model, and no tensor computed inside it, has a dim that reaches "
            "the sequence dim of its attention's q, k and v: ringify follows the sequence "
            "from where it is created (token ids, embeddings, a patch embedding) through ops "
            "that act per position. "
            + (
                f"{len(unsized)} attentions ({', '.join(unsized[:3])}, ...) run over a "
                "sequence whose length the data decides (tokens picked by a mask): pad them "
                "to a fixed length and mask the padding, or run the model unmodified. "
                if unsized
                else ""
            )
            + "Set RINGIFY_DUMP_DIR=<folder> to see the graph, and report the op between the "
            "sequence and attention"
        )
    return seeds


def _births(
    graph: fx.Graph, config: Config, seeds: dict[fx.Node, Seq], targets: list[fx.Node]
) -> dict[fx.Node, Seq]:
    """Nodes where the sequence of an attention the ``seeds`` do not reach is born: tried in
    graph order among the targets' ancestors with a dim as long as an attention's sequence;
    one is kept if it reaches more targets and loses none."""
    lengths = {shape(t)[2] for t in targets}
    if not lengths:
        return {}
    geometry = SequenceGeometry(max(lengths), max(lengths), config.ring_size, config.layout)
    place = infer_placements(graph, geometry, seeds).place

    def reached(p) -> set[fx.Node]:
        return {t for t in targets if p[t] == Seq(2)}

    found: dict[fx.Node, Seq] = {}
    above = ancestors(targets)
    for node in graph.nodes:
        if len(reached(place)) == len(targets):
            break
        if node.op != "call_function" or node not in above or place[node] is not None:
            continue
        if not is_tensor(node) or any(place[a] is not None for a in node.all_input_nodes):
            continue  # a birth is computed whole from replicated tensors, not gathered ones
        for dim, size in enumerate(shape(node)):
            if not isinstance(size, int) or size < 2 or size not in lengths:
                continue
            geometry = SequenceGeometry(size, size, config.ring_size, config.layout)
            trial = infer_placements(graph, geometry, seeds | found | {node: Seq(dim)}).place
            if reached(trial) > reached(place):  # a strict superset
                found[node], place = Seq(dim), trial
                break
    return found


def _check_attention_shapes(attentions: list, config: Config) -> None:
    """Name the cause when no attention can be sharded: empty, not 4-D, or one position."""
    for a in attentions:
        shapes = [tuple(shape(x)) for x in (a.q, a.k, a.v)]
        if any(0 in s for s in shapes):
            raise ValueError(
                f"attention {a.node.name} has an empty q, k or v (shapes {shapes}): a sequence "
                "of length 0, or 0 heads, cannot be split over a ring; skip empty batches"
            )
    if all(len(shape(a.q)) != 4 for a in attentions):
        found = sorted({len(shape(a.q)) for a in attentions})
        raise ValueError(
            f"the model calls scaled_dot_product_attention on {found}-D q, k and v; ringify "
            "shards 4-D (batch, heads, sequence, head_dim) attention, the multi-head form "
            "every transformer layer uses. Unbatched or extra-dim calls are not supported"
        )
    if all(shape(a.q)[-2] == 1 for a in attentions):
        raise ValueError(
            "every attention's sequence has length 1: there is nothing to split over a ring "
            f"of {config.ring_size}. Run single-position calls (a decoding step, say) with "
            "the unmodified model"
        )


def _companion_inputs(
    graph: fx.Graph, seeds: dict[fx.Node, Seq], geometry: SequenceGeometry
) -> dict[fx.Node, Seq]:
    """Inputs that never reach attention but meet the sharded sequence (labels, say)."""
    found: dict[fx.Node, Seq] = {}
    for node, seq in infer_placements(graph, geometry, seeds).place.meetings:
        while node.op == "call_function" and isinstance(seq, Seq):
            x = node.args[0] if node.args else None
            if not is_tensor(x):
                break
            if node.target in VIEWS:
                seq = view_placement(list(val(node).shape), seq, shape(x), geometry)
            elif node.target not in SAME_SHAPE | CASTS_LIKE | KEEPS_POSITIONS:
                break
            node = x
        if node.op == "placeholder" and isinstance(seq, Seq) and node not in seeds:
            found.setdefault(node, seq)
    return found


def _mask_inputs(
    graph: fx.Graph, seeds: dict[fx.Node, Seq], geometry: SequenceGeometry
) -> dict[fx.Node, Seq]:
    """Inputs, besides ``seeds``, that some attention's mask is computed from, and the dim
    whose positions reach the mask's query or key dim, followed through the graph
    (``positions_held``): a (batch, sequence) mask whose batch is as long is read right."""
    found: dict[fx.Node, Seq] = {}
    for mask in [a.mask for a in find_attention(graph) if a.mask is not None]:
        region = sorted(ancestors([mask]), key=_order(graph))
        for node in region:
            if node.op != "placeholder" or node in seeds or not is_tensor(node):
                continue
            for d, size in enumerate(shape(node)):
                held = [] if size != geometry.length else _ends(mask, region, node, d)
                if any(at.dim == end for end, ats in held if ats for at in ats):
                    found[node] = Seq(d)
    return found


def _ends(mask: fx.Node, region: list[fx.Node], source: fx.Node, dim: int) -> list:
    """(the query or key dim, the positions held) of the values that end ``mask``'s
    subgraph, ``source`` holding the sequence on ``dim``: a program's inputs (by role) or
    the mask itself."""
    held = positions_held([n for n in region if n.op != "placeholder"], {source: Seq(dim)})
    if mask.target is not program_mask:
        ndim = len(shape(mask))
        return [(ndim - 1, held.get(mask)), (ndim - 2, held.get(mask))]
    roles = parse(mask.args[0]).roles
    return [
        (len(shape(x)) - (1 if role == "k" else 2), held.get(x))
        for role, x in zip(roles, mask.args[1], strict=True)
        if role in ("q", "k")
    ]


def _order(graph: fx.Graph):
    index = {n: i for i, n in enumerate(graph.nodes)}
    return index.__getitem__


def _geometry(graph: fx.Graph, config: Config, general: bool = False) -> SequenceGeometry:
    """The sequence's length, and the padded length the ring splits (the padding decision);
    ``general``: the padding steps kept where this length needs none."""
    attentions, tokens = find_attention(graph), _tokens(graph)
    if attentions or tokens is None:
        length = _sequence_length(attentions)
    else:
        node, seq = tokens
        length = shape(node)[seq.dim]
    padded = padded_length(length, config.ring_size, config.layout)
    multiple = split_multiple(config.ring_size, config.layout)
    if padded != length and config.dilation is not None:
        raise ValueError(
            f"sequence length {length} does not split into {multiple} equal chunks; dilated "
            f"attention's segments cannot be padded: use a multiple of {multiple}"
        )
    if padded != length and config.outputs == "sharded":
        raise ValueError(
            f"sequence length {length} does not split into {multiple} equal chunks (ring size "
            f"{config.ring_size}, layout {config.layout!r}); with outputs='sharded' the "
            f"padding would reach the outputs: pad the inputs to a multiple of {multiple}, "
            "or use outputs='full'"
        )
    return SequenceGeometry(length, padded, config.ring_size, config.layout, general)
