"""The decode step's graph: one new token's forward over a KV cache split across the ring.

``ringify/generation/step.py`` exports the model's decode step with an HF cache whose
length T is symbolic: one graph for every step. In it each layer appends the new
token's key and value to the cache (``cat([cache, new], -2)``) and attends with the
new query to the result. ``rewrite_decode`` makes that what one rank of the ring runs:

- each attention becomes ``decode_attention`` over this rank's part of the layer's cache
  (new inputs: ``local_keys``/``local_values``), the new key and value, and the mask row
  at this rank's key positions (``positions``: its cached positions, then the new
  token's). The mask row is the model's own (a program, evaluated for one query row):
  O(T) per step, computed once and shared by the layers that share it;
- the cache outputs become the new entries, which the caller stores on one rank;
- the cache inputs are read only for their size (the global T, from which the model
  derives its positions and mask sizes): the caller passes zero-stride tensors.

A model whose attention does not read its keys and values from the cache so (another
cache type, attention that reads the cache twice) is refused with what is supported.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch._guards import detect_fake_mode

from ringify.passes.graph.attention_nodes import read_attention
from ringify.passes.graph.nodes import ancestors, call, erase_unused, evaluate, shape, uses, val
from ringify.runtime.attention.memory_attention import decode_attention_op
from ringify.runtime.attention.reference import attention as reference_attention
from ringify.runtime.attention.spec import AttentionSpec, sdpa_scale

aten = torch.ops.aten
SUPPORTED = (
    "ringify's generate shards HF's DynamicCache of attention layers (full or sliding "
    "window) read by scaled_dot_product_attention (attn_implementation='sdpa' or 'eager', "
    "sinks and soft caps included)"
)


class NotDecodable(ValueError):
    """The decode step's graph is not one ringify can split; the message says why."""


def rewrite_decode(graph: fx.Graph, cache: dict[fx.Node, tuple[str, int]], group_name: str) -> None:
    """Rewrite the exported decode step ``graph`` in place (``cache``: each cache input's
    placeholder -> ("key" | "value", layer)). The inputs it adds, after the graph's own: per
    layer this rank's cached keys, then per layer its values; this rank's key positions
    (its cached keys' and the new token's); how many of them it attends to (the new one
    counts where this rank stores it)."""
    layers = 1 + max(layer for _, layer in cache.values())
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    like = {kind: next(x for x, (k, _) in cache.items() if k == kind) for kind in ("key", "value")}
    with graph.inserting_after(last):
        added = _inputs(graph, like, layers)
    local = {("key", i): added[i] for i in range(layers)}
    local |= {("value", i): added[layers + i] for i in range(layers)}
    positions, key_len = added[-2:]
    rows: dict[fx.Node, fx.Node] = {}  # mask -> its row at this rank's positions
    done = set()
    for node in list(graph.nodes):
        if node.target not in (aten.scaled_dot_product_attention.default, reference_attention):
            continue
        att = read_attention(node)
        q, k, v, mask, scale, softcap = att.q, att.k, att.v, att.mask, att.scale, att.softcap
        if softcap and shape(v)[-1] != shape(q)[-1]:
            raise NotDecodable(f"{node.name}: a soft cap with MLA's value head dim. {SUPPORTED}")
        if _is_appended(k) and _is_appended(v):
            (k_layer, k_new), (v_layer, v_new) = _appended(k, cache), _appended(v, cache)
            k_local, v_local = local[k_layer], local[v_layer]
        else:  # MLA's latents, expanded into keys and values at each step
            with graph.inserting_before(node):
                k_layer, v_layer, (k_local, k_new), (v_local, v_new) = _expanded(
                    graph, k, v, cache, local
                )
        if (
            k_layer != ("key", v_layer[1])
            or v_layer[0] != "value"
            or att.dropout_p
            or att.is_causal
        ):
            raise NotDecodable(f"{node.name} does not attend to one layer's cache. {SUPPORTED}")
        if k_layer in done:
            raise NotDecodable(f"{node.name} reads layer {k_layer[1]}'s cache twice. {SUPPORTED}")
        done.add(k_layer)
        keep = None
        if mask is not None:
            if mask not in rows:
                with graph.inserting_before(node):
                    rows[mask] = _row(graph, mask, positions)
            keep = rows[mask]
        spec = AttentionSpec(group_name, sdpa_scale(scale, shape(q)[-1]), softcap=softcap)
        args = (q, k_local, v_local, keep, [k_new, v_new], key_len, spec, None, att.sinks)
        with graph.inserting_before(node):
            decoded = call(graph, decode_attention_op._opoverload, args)
            out = call(graph, operator.getitem, (decoded, 0))
        node.replace_all_uses_with(out)
        graph.erase_node(node)
    if len(done) != layers:
        raise NotDecodable(f"{layers - len(done)} layers' caches are not read. {SUPPORTED}")
    _outputs_as_new_entries(graph, cache)
    _check_read_for_size_only(cache)
    graph.lint()


def _inputs(graph: fx.Graph, like: dict[str, fx.Node], layers: int) -> list[fx.Node]:
    """The placeholders of this rank's cache, positions and key count, with values whose
    cache length is a new symbol (it differs from rank to rank and step to step); keys and
    values each shaped like the cache's (MLA's values have a head dim of their own)."""
    key = val(like["key"])
    mode = detect_fake_mode([key])
    with mode:
        n = mode.shape_env.create_unbacked_symint()
        torch._check(n >= 0)
        k, v = (
            torch.empty(*val(x).shape[:2], n, val(x).shape[3], dtype=key.dtype, device=key.device)
            for x in (like["key"], like["value"])
        )
        positions = torch.empty(n + 1, dtype=torch.long, device=key.device)
    made = []
    names = [f"local_keys_{i}" for i in range(layers)] + [
        f"local_values_{i}" for i in range(layers)
    ]
    for name in reversed(
        [*names, "positions", "key_len"]
    ):  # each goes right after the last placeholder
        made.insert(0, graph.placeholder(name))
    values = [k] * layers + [v] * layers + [positions, n + 1]
    for node, value in zip(made, values, strict=True):
        node.meta["val"] = value
    return made


def _is_appended(x) -> bool:
    return isinstance(x, fx.Node) and x.target is aten.cat.default and len(x.args[0]) == 2


def _expanded(graph: fx.Graph, k: fx.Node, v: fx.Node, cache: dict, local: dict) -> tuple:
    """MLA with a cache of latents (transformers 5.24's DeepSeek-V3): k and v are computed
    position by position from ``cat([cache, new], -2)`` of each latent. For the attention,
    each cat becomes this rank's latents with the new one, and the sizes along the sequence
    inside are read from it: k and v then hold this rank's positions, the new token's last.
    Returns the two cache entries and ``(this rank's part, the new token's)`` of k and v."""
    above = ancestors([k, v])
    cats = [n for n in graph.nodes if n in above and _is_appended(n) and _reads_cache(n, cache)]
    entries = {_appended(c, cache)[0] for c in cats}
    layer = {i for _, i in entries}
    if len(layer) != 1 or entries != {("key", *layer), ("value", *layer)}:
        raise NotDecodable(f"{k.name} is not computed from one layer's cache. {SUPPORTED}")
    length = val(cats[0]).shape[2]  # the global length the region was traced at
    region, reached = [], set(cats)
    for node in graph.nodes:
        if node not in cats and node in above and reached.intersection(node.all_input_nodes):
            reached.add(node)
            region.append(node)
    outside = [u for n in region if n not in (k, v) for u in n.users if u not in reached]
    if outside or len(k.users) > 1 or len(v.users) > 1:
        raise NotDecodable(f"{k.name}: MLA's expanded cache is read beyond the attention")
    for cat in cats:
        old, new = cat.args[0]
        with graph.inserting_before(cat.next):  # where the latents, cached and new, are
            mine = call(graph, aten.cat.default, ([local[_cache_entry(old, cache)], new], 2))
            size = call(graph, aten.sym_size.int, (mine, 2))
        for node in region:
            node.args, node.kwargs = fx.node.map_arg(
                (node.args, node.kwargs),
                lambda a, cat=cat, mine=mine, size=size: (
                    mine if a is cat else size if _is_size(a, length) else a
                ),
            )
    for node in region:  # this rank's values, in graph order
        node.meta["val"] = evaluate(node)
    parts = [
        (call(graph, aten.slice.Tensor, (x, 2, 0, -1)), call(graph, aten.slice.Tensor, (x, 2, -1)))
        for x in (k, v)
    ]
    return ("key", *layer), ("value", *layer), *parts


def _reads_cache(cat: fx.Node, cache: dict) -> bool:
    try:
        _cache_entry(cat.args[0][0], cache)
    except NotDecodable:
        return False
    return True


def _is_size(a, length) -> bool:
    """Whether ``a`` is a node of the symbolic size ``length``."""
    size = val(a) if isinstance(a, fx.Node) else None
    return isinstance(size, torch.SymInt) and size.node.expr == length.node.expr


def _appended(x, cache: dict) -> tuple[tuple[str, int], fx.Node]:
    """``(cache entry, new)`` where ``x`` is ``cat([the cache input, new], -2)``."""
    if not (isinstance(x, fx.Node) and x.target is aten.cat.default and len(x.args[0]) == 2):
        raise NotDecodable(
            f"{getattr(x, 'name', x)} is not the cache with the new token. {SUPPORTED}"
        )
    old, new = x.args[0]
    dim = x.args[1] if len(x.args) > 1 else 0
    if dim % len(shape(x)) != 2 or shape(new)[2] != 1:
        raise NotDecodable(f"{x.name} does not append one token to the cache. {SUPPORTED}")
    return _cache_entry(old, cache), new


def _cache_entry(x: fx.Node, cache: dict) -> tuple[str, int]:
    """The cache input ``x`` is, through HF's concatenation with empty initial tensors."""
    while x not in cache:
        if not (x.target is aten.cat.default and len(x.args[0]) >= 1):
            raise NotDecodable(f"{x.name} is not read from the cache. {SUPPORTED}")
        kept = [a for a in x.args[0] if not any(n == 0 for n in shape(a) if isinstance(n, int))]
        if len(kept) != 1:
            raise NotDecodable(f"{x.name} joins more than the cache. {SUPPORTED}")
        x = kept[0]
    return cache[x]


def _row(graph: fx.Graph, mask: fx.Node, positions: fx.Node) -> fx.Node:
    """The mask's single query row at this rank's key positions (a broadcast column as is)."""
    if shape(mask)[-1] == 1:
        return mask
    return call(graph, aten.index_select.default, (mask, -1, positions))


def _outputs_as_new_entries(graph: fx.Graph, cache: dict) -> None:
    """Each output that is a layer's whole cache (the cat) becomes the new entries alone."""
    output = graph.output_node()

    def new_entries(a):
        if isinstance(a, fx.Node) and a.target is aten.cat.default and len(a.args[0]) == 2:
            _cache_entry(a.args[0][0], cache)  # raises unless it is a cache with the new token
            return a.args[0][1]
        return a

    cats = [a for a in output.all_input_nodes if a.target is aten.cat.default]
    output.args = fx.node.map_arg(output.args, new_entries)
    for cat in cats:
        erase_unused(graph, cat)


def _check_read_for_size_only(cache: dict) -> None:
    for x in cache:
        for user in uses(x):
            if user.target is not aten.sym_size.int:
                raise NotDecodable(
                    f"{user.name} ({user.target}) reads the values of the cache input {x.name} "
                    f"beyond the attention. {SUPPORTED}"
                )
