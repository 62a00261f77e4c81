"""The model's decode step, traced once and run for every new token, and the split cache it reads.

``DecodeStep`` exports the unmodified model's forward for one new token with an HF
``DynamicCache`` whose length is symbolic (``torch.export``'s ``Dim.AUTO``): one graph
serves every step, whatever the cache's length. ``passes/decode.py`` rewrites it so that
each rank attends to its own part of the cache (``ShardedCache``), and the
model's state is lifted out as for the ringified forward (``trace.py``). The graph runs
as it is, with no further trace; should the export have constrained the length (a
model that branches on it), a length outside its range is traced again, and said.

``ShardedCache`` is this rank's part of a KV cache that stays split across the ring while
tokens are decoded. After the ringified prefill each rank holds its chunks of every layer's K/V (the
layout's, e.g. zigzag) and knows their global positions. Each decoded token's K/V are
stored on one rank: the one holding the fewest entries (the lowest such rank on a tie),
which every rank computes alike, so that the parts stay within one entry of each other.

Room for this rank's share of the new tokens is reserved once, layer by layer as the
prefill's tensors are released (at most one layer's part is held twice, briefly), so
that a step writes its entry in place rather than copying the cache. What a step reads
(``keys``, ``values``, ``positions``) are views of exactly the entries held.
"""

from __future__ import annotations

import inspect
import logging

import torch
from torch import fx, nn
from torch.export import Dim
from torch.fx._pytree import tree_flatten_spec
from torch.utils import _pytree as pytree

from ringify.passes.decode import SUPPORTED, NotDecodable, rewrite_decode
from ringify.passes.pipeline import DECODE_STEP, folded, lift_state
from ringify.runtime.collectives.ring import Ring
from ringify.tracing.caches import cache_keyword, cache_of, exportable_dynamic_cache
from ringify.tracing.observers import hooked
from ringify.tracing.trace import buffers_kept, state_of

log = logging.getLogger("ringify")
_EXAMPLE_LENGTH = 7  # the cache length the step is traced at (not 0 or 1, which export pins)


class DecodeStep:
    """One token's forward over ``ShardedCache``: ``(logits, new keys, new values)``.

    ``inputs``: the model's keyword inputs of a step besides the cache (ids, attention mask,
    position ids), as tensors of the step's shapes; ``like``: the prefill's cache part of
    each layer (shapes, dtype and device of the cache)."""

    def __init__(self, model: nn.Module, ring: Ring, inputs: dict, like: list):
        self.model, self.ring = model, ring
        self.traces = 0
        # per layer, the key's and the value's shape (MLA's differ), dtype and device
        self._like = [((k.shape, v.shape), k.dtype, k.device) for k, v in like]
        # one element per layer, expanded to the cache's global shape at each step
        self._carriers = [torch.empty((), dtype=t, device=d) for _, t, d in self._like]
        self._keys = sorted(inputs)  # the step's inputs, by name
        self._cache_keyword = cache_keyword(model)
        # an MoE's router statistics (its aux loss) are no output of a decode step, as in HF's
        # generate: over one new token they would meet the mask of every cached one
        takes = inspect.signature(model.forward).parameters
        self._quiet = {"output_router_logits": False} if "output_router_logits" in takes else {}
        self._trace(inputs, _EXAMPLE_LENGTH)

    def _trace(self, inputs: dict, length: int) -> None:
        from transformers import DynamicCache

        exportable_dynamic_cache()
        cache = DynamicCache([
            tuple(torch.zeros(*s[:2], length, s[3], dtype=t, device=d) for s in shapes)
            for shapes, t, d in self._like
        ])  # fmt: skip
        keyword = self._cache_keyword
        kwargs = {k: inputs[k] for k in self._keys} | {keyword: cache, "use_cache": True}
        kwargs |= self._quiet
        kwargs = _with_length(kwargs, length)
        dynamic = {k: _dynamic(k, x) for k, x in kwargs.items() if k != keyword}
        dynamic[keyword] = [[{2: Dim.AUTO}] * len(self._like)] * 2
        if paths := hooked(self.model):
            log.warning(
                "ringify: generate's decode step runs the graph traced for it, which calls no "
                "hook of %s: hooks that observe run at every prefill, not at each new token. "
                "To observe each token, run the model's own generate.",
                ", ".join(paths),
            )
        try:
            with buffers_kept(self.model):
                exported = torch.export.export(
                    self.model, (), kwargs, dynamic_shapes=dynamic, strict=False
                )
        except Exception as e:
            raise ValueError(
                f"ringify could not trace {type(self.model).__name__}'s decode step "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). {SUPPORTED}."
            ) from e
        gm = folded(exported, DECODE_STEP)
        ids = {id(t): (kind, i) for i, layer in enumerate(cache.layers)
               for kind, t in (("key", layer.keys), ("value", layer.values))}  # fmt: skip
        flat = tree_flatten_spec(((), kwargs), exported.call_spec.in_spec)
        self._sources = [
            ids.get(id(x), x if not isinstance(x, torch.Tensor) else None) for x in flat
        ]
        self._names = _leaf_names(kwargs, exported.call_spec.in_spec)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        cache_nodes = {
            p: s for p, s in zip(placeholders, self._sources, strict=True) if isinstance(s, tuple)
        }
        lengths = _length_range(exported, cache_nodes)
        try:
            rewrite_decode(gm.graph, cache_nodes, self.ring.name)
        except NotDecodable as e:
            raise ValueError(
                f"ringify cannot generate with {type(self.model).__name__}: {e}"
            ) from None
        self.state_names = lift_state(gm.graph, self.model)
        self.module = fx.GraphModule(gm, gm.graph)
        self._places = _output_places(exported.call_spec.out_spec)
        self.lengths = lengths
        self.traces += 1

    def __call__(self, inputs: dict, cache: ShardedCache):
        """``(logits, [new key per layer], [new value per layer])`` of the step whose inputs
        are ``inputs`` (the model's, of this step), over ``cache``."""
        if not self.lengths[0] <= cache.length <= self.lengths[1]:
            log.warning(
                "ringify: the decode step was traced for cache lengths %s to %s; tracing it "
                "again for %d",
                *self.lengths,
                cache.length,
            )
            self._trace(inputs, cache.length)
        flat = []
        for name, source in zip(self._names, self._sources, strict=True):
            if isinstance(source, tuple):  # the cache's global shape only: no values are read
                kind, layer = source
                shape = self._like[layer][0][kind == "value"]
                flat.append(self._carriers[layer].expand(*shape[:2], cache.length, shape[3]))
            else:
                flat.append(inputs.get(name, source))
        local = [cache.keys(i) for i in range(cache.layers)]
        local += [cache.values(i) for i in range(cache.layers)]
        key_len = local[0].shape[2] + (cache.owner() == self.ring.rank)  # the new key: its owner's
        state = state_of(self.model, self.state_names)
        out = self.module(*state, *flat, *local, cache.positions(), key_len)
        logits, keys, values = self._places
        return out[logits], [out[i] for i in keys], [out[i] for i in values]


def _output_places(spec) -> tuple[int, list[int], list[int]]:
    """Where the step's logits and each layer's new key and value lie among its flat outputs,
    read once from the output's structure: unflattening HF's cache at every token would
    build it anew, a tensor created and a copy made per layer and token. Each leaf is tagged
    with its index (4-D: HF's cache concatenates its leaves onto empty ones)."""
    tags = [torch.full((1, 1, 1, 1), float(i)) for i in range(spec.num_leaves)]
    result = pytree.tree_unflatten(tags, spec)
    layers = cache_of(result).layers

    def place(tagged: torch.Tensor) -> int:
        return int(tagged.reshape(-1)[-1])  # host tensors of the trace: no device read

    return (
        place(result.logits),
        [place(layer.keys) for layer in layers],
        [place(layer.values) for layer in layers],
    )


def _with_length(kwargs: dict, length: int) -> dict:
    """The step's inputs for a cache of ``length``: the attention mask over it and the new token."""
    out = dict(kwargs)
    if "attention_mask" in out:
        mask = out["attention_mask"]
        out["attention_mask"] = mask.new_ones(mask.shape[0], length + 1)
    if "position_ids" in out:
        out["position_ids"] = torch.full_like(out["position_ids"], length)
    return out


def _dynamic(name: str, x):
    if name == "attention_mask" and isinstance(x, torch.Tensor):
        return {1: Dim.AUTO}
    return None


def _leaf_names(kwargs: dict, spec) -> list:
    """The keyword each flat input comes from (a cache entry: the cache's keyword)."""
    names = []
    for key, value in kwargs.items():
        names += [key] * len(pytree.tree_leaves(value))
    if len(names) != spec.num_leaves:
        raise ValueError("ringify: the decode step's inputs flatten unlike its trace")
    return names


def _length_range(exported, cache_nodes: dict) -> tuple[int, float]:
    """The cache lengths the exported step is valid for (the range of its cache length's
    symbol), read from the inputs that are cache entries: a full layer's length is the symbol
    itself, a sliding layer's an expression of it (its window's part)."""
    sizes = [node.meta["val"].shape[2] for node in cache_nodes]
    for size in sizes:
        if isinstance(size, int):
            return size, size
    for size in sorted(sizes, key=lambda s: not s.node.expr.is_symbol):
        symbols = size.node.expr.free_symbols
        if len(symbols) == 1 and next(iter(symbols)) in exported.range_constraints:
            bounds = exported.range_constraints[next(iter(symbols))]
            return int(bounds.lower), float(bounds.upper)
    return 0, float("inf")


class ShardedCache:
    """Per layer this rank's cached keys and values (B, K, n, D), and their positions.

    ``parts``: the prefill's ``(keys, values)`` per layer (released as they are copied);
    ``positions``: their global positions (n,); ``reserve``: room for this many new tokens
    on this rank; ``length``: the global number of positions cached (every rank's).
    """

    def __init__(self, parts: list, positions: torch.Tensor, ring: Ring, reserve: int, length: int):
        n = positions.numel()
        self.ring, self.filled, self.length = ring, n, length
        self.counts = [n] * ring.size  # every rank's number of entries, known to all
        self._keys, self._values = [], []
        while parts:
            k, v = parts.pop(0)
            for held, x in ((self._keys, k), (self._values, v)):
                b, heads, _, d = x.shape
                buffer = x.new_empty(b, heads, n + reserve, d)
                buffer[:, :, :n].copy_(x)
                held.append(buffer)
            del k, v, x
        self._positions = torch.empty(n + reserve + 1, dtype=torch.long, device=positions.device)
        self._positions[:n].copy_(positions)

    @property
    def layers(self) -> int:
        return len(self._keys)

    def owner(self) -> int:
        """The rank that stores the next token's entries."""
        return min(range(self.ring.size), key=lambda r: (self.counts[r], r))

    def keys(self, layer: int) -> torch.Tensor:
        return self._keys[layer][:, :, : self.filled]

    def values(self, layer: int) -> torch.Tensor:
        return self._values[layer][:, :, : self.filled]

    def positions(self) -> torch.Tensor:
        """This rank's cached positions, then the next token's (``length``)."""
        self._positions[self.filled] = self.length
        return self._positions[: self.filled + 1]

    def append(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Store the next token's (B, K, 1, D) entries of every layer on its owner."""
        owner = self.owner()
        if owner == self.ring.rank:
            if self.filled == self._keys[0].shape[2]:
                raise RuntimeError("ringify: the decode cache's reserved room is used up")
            for held, new in ((self._keys, keys), (self._values, values)):
                for buffer, x in zip(held, new, strict=True):
                    buffer[:, :, self.filled : self.filled + 1].copy_(x)
            self.filled += 1
        self.counts[owner] += 1
        self.length += 1

    def nbytes(self) -> int:
        """The bytes of the entries held (not the reserved room)."""
        return sum(self.keys(i).nbytes + self.values(i).nbytes for i in range(self.layers))

    def as_dynamic_cache(self):
        """The entries held as HF's ``DynamicCache`` (views, no copy)."""
        from transformers import DynamicCache

        cache = DynamicCache(
            [(k[:, :, :0], v[:, :, :0]) for k, v in zip(self._keys, self._values, strict=True)]
        )
        for i, layer in enumerate(cache.layers):
            layer.keys, layer.values = self.keys(i), self.values(i)
        return cache
