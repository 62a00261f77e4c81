"""A ring call's plan: what the op decides from its mask before touching q, k or v, as a value.

Under a mask program, the op decides from the program and its O(S) inputs: the tiling
(finer under a window), each tile pair's visibility and each open pair's blocks, how far
each K/V tile travels, and the balanced assignment of query tiles. Every layer of a model
asks the same question with the same inputs, in its forward and again in its backward;
FlexAttention answers it once per step with one ``BlockMask``, which travels into every
``flex_attention`` call as an argument. So does a ``RingPlan``:

- ``ringify::host_inputs`` copies the program's inputs to the host in one copy (the only
  device-to-host read of a plan, ``captures.py``) and ``ringify::attention_plan`` builds
  the plan there, where every decision reads host tensors for free and none is mixed with
  a device tensor;
- the graph pass emits one such node per distinct program, inputs and geometry, before the
  first layer; its output, the plan itself (a ``torch.library`` opaque object), is an
  argument of every ring op under it, forward and backward (kept for the backward on the
  autograd context, and so for a checkpoint's recompute);
- a plan holds what the step's calls share on the host: its tile masks' answers and where
  its masks lie in the two tensors ``ringify::step_masks`` makes from it once per step on
  the device (``step_layout.py``), which the graph gives every ring call beside it. Its
  ``calls`` and ``tile_counts`` count the ring calls that ran on it and the tile pairs they
  saw. A ring op given no plan (the public op called directly) builds its own, at one read.

The host-side answers are a pure function of the geometry, the program and its inputs'
bytes: they are memoised by that content (``_Memo``, the last ``MAX_LAYOUTS``), so that a
step whose mask the last step had (no padding, a fixed packing) decides nothing again; a
new step's plan is a new value around them, with its own counts.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch
from torch._library.opaque_object import get_opaque_type_name, register_opaque_type
from torch._opaque_base import OpaqueBase

from ringify.runtime.collectives.heads import TRANSPORT_TYPE, Transport
from ringify.runtime.collectives.ring import Ring, ring_by_name, served_devices
from ringify.runtime.masks.balance import balanced_tiling, min_gain_area
from ringify.runtime.masks.bounds import program_tiles_per_chunk
from ringify.runtime.masks.captures import check_captured, host_copy
from ringify.runtime.masks.step_layout import Capacity, GivenMasks, StepLayout, step_layout
from ringify.runtime.masks.tile_masks import CallMasks, TileMasks
from ringify.runtime.tiling import tiles
from ringify.runtime.tiling.tiles import (
    Tile,
    Tiling,
    Visibility,
    all_tiles,
    needs_positions,
    shard_tiles,
    sub_ring_tiles,
)


@dataclass(frozen=True)
class CallGeometry:
    """The calls a plan serves: their ring (its group's ``ring`` name and ``ring_size``), each
    rank's query ``rows``, causality, the sequence's ``layout`` over the ring and ``key_len``
    (keys at or beyond it are padding); and what shapes the plan's tiles: a forced
    ``tiles_per_chunk`` (0: the op's choice), whether it may ``balance``, and the
    ``device_type`` its calls run on."""

    ring: str
    ring_size: int
    rows: int
    is_causal: bool
    layout: str
    key_len: int
    tiles_per_chunk: int = 0
    balance: bool = True
    device_type: str = "cpu"

    def call(self) -> tuple:
        """What a call must share with the plan it is given: all but the tiling options."""
        return (self.ring, self.ring_size, self.rows, self.is_causal, self.layout, self.key_len)


MAX_LAYOUTS = 32  # host-side answers memoised: a model has a few programs, a step one each


class RingPlan(OpaqueBase):
    """How the calls of one step run: ``home(rank)`` tiles that rank's shard (its K/V tiles
    travel so), ``queries(rank)`` the query tiles it works on (``home`` unless balanced),
    ``masks`` every pair's visibility. ``balanced``: None where balancing does not apply.
    ``geometry``: the calls it was made for. ``key``: its site and the content of its
    program's inputs (``plan_for``), None where it reads no tensor's values. ``transport``:
    under an all-to-all onto heads (``Transport``: Ulysses or the hybrid), each rank holds
    every row of its group's shards for its share of the heads, and the plan is that of the
    ring of the groups (one rank's over the whole sequence under Ulysses). ``calls``
    and ``tile_pairs``: the ring calls (forward and backward) that ran on it, balanced or
    not, and the tile pairs they saw."""

    def __init__(self, home: Tiling | None, queries: Tiling | None, masks: TileMasks | None,
                 balanced: bool | None, geometry: CallGeometry | None,
                 transport: Transport | None = None, key: tuple | None = None) -> None:  # fmt: skip
        self.home, self.queries, self.masks = home, queries, masks
        self.key = key
        self.balanced, self.geometry = balanced, geometry
        self.transport = transport or Transport(geometry.ring_size if geometry else 1)
        self.calls: Counter = Counter()
        self.tile_pairs: Counter = Counter()  # by the value of each pair's ``Visibility``

    @classmethod
    def unbuilt(cls) -> RingPlan:
        """The value a fake kernel gives: a plan's place in a traced graph, with no content."""
        return cls(None, None, None, None, None)

    def count_call(self) -> None:
        self.calls["kept" if not self.balanced else "balanced"] += 1

    def step_layout(self, dtype: torch.dtype, varlen: bool, capacity: Capacity) -> StepLayout:
        """Where this rank's masked blocks and varlen sequences lie in the step's masks
        (``step_layout.py``) of ``capacity``, for calls whose biases are in ``dtype`` and which
        run open pairs as FA2 varlen calls (``varlen``); empty where nothing is laid out (no
        program, a mask tensor, the all-to-all)."""
        masks = self.masks
        if masks is None:
            return StepLayout(dtype)
        rank = ring_by_name(self.geometry.ring).rank
        if masks.mask is not None or not self.transport.is_ring:
            capacity = Capacity(0, 0)
        key = (rank, dtype, varlen, capacity)
        if key not in masks.layouts:  # host answers shared by every plan of the content
            masks.layouts[key] = step_layout(
                masks, self.home, self.queries, rank, dtype, varlen, capacity
            )
        return masks.layouts[key]

    def bound_masks(
        self, inputs: list[torch.Tensor], device: torch.device, dtype: torch.dtype,
        varlen: bool, step_masks: list[torch.Tensor] | None, recording: bool = False,
        heads: tuple[int, int] = (0, 1),
    ) -> CallMasks:  # fmt: skip
        """The tile masks of a call of this step on ``device``, its program's ``inputs`` as the
        call holds them and ``step_masks`` the step's masks (None: none given), for biases in
        ``dtype`` and FA2 varlen calls where ``varlen``; its pairs counted here.
        ``recording``: the call is being recorded into a CUDA graph, so it copies no varlen
        sequences from the host (a copy a graph cannot record). ``heads``: the share of the
        heads the call attends with (an all-to-all's, ``P2PRing.head_share``)."""
        given = None
        if step_masks is not None:
            biases, sequences = step_masks
            if biases.dtype != dtype:
                raise RuntimeError(
                    f"ringify: the step's masks were made in {biases.dtype}, for calls whose "
                    f"biases are in {dtype}"
                )
            capacity = Capacity(biases.shape[0], sequences.shape[1])
            given = GivenMasks(self.step_layout(dtype, varlen, capacity), biases, sequences)
        return CallMasks(
            self.masks, inputs, device, dtype, varlen, given, self.tile_pairs, not recording, heads
        )

    def tile_counts(self) -> dict[Visibility, int]:
        """How many tile pairs the forward calls on this plan skipped, ran causal, ran with no
        mask and ran with a bias."""
        return {v: self.tile_pairs[v.value] for v in Visibility}

    def summary(self) -> dict:
        """What the plan decided, per rank: the tile pairs it works on (of those a dense ring
        would), the K/V rows it sends in a call (of K and of V each), and its balance's work
        (query rows x keys that may be seen)."""
        if self.masks is None:
            return {}
        masks, size = self.masks, self.masks.ring_size
        tiles = all_tiles(self.home, size)
        pairs, dense, work = [0] * size, [0] * size, [0] * size
        for rank in range(size):
            for q in self.queries(rank):
                dense[rank] += len(tiles)
                for k in (k for k in tiles if masks.may_see(q, k)):
                    pairs[rank] += 1
                    work[rank] += q.length * masks.keys(k)
        sent = [0] * size  # a rank's K/V tiles go on as far as some rank sees them
        for j in sorted({t.sub_ring for t in self.home(0)}):
            last = masks.last_steps(j)
            for src in range(size):
                rows = sum(t.length for t in sub_ring_tiles(self.home(src), j))
                for step in range(max(last[src], 0)):  # held by rank src + step, sent on
                    sent[(src + step) % size] += rows
        return {
            "tile pairs": pairs,
            "dense tile pairs": dense,
            "work": work,
            "K/V rows sent": sent,
            "balanced": self.balanced,
            "ring": size,
            "transport": str(self.transport),
        }

    def __repr__(self) -> str:
        if self.masks is None:
            return "RingPlan(unbuilt)"
        s = self.summary()
        pairs, dense = sum(s["tile pairs"]), max(sum(s["dense tile pairs"]), 1)
        return (
            f"RingPlan(ring={s['ring']}, sparsity={1 - pairs / dense:.2f}, "
            f"tile pairs per rank={s['tile pairs']}, work per rank={s['work']}, "
            f"K/V rows sent per call={s['K/V rows sent']}, balanced={s['balanced']}, "
            f"transport={self.transport})"
        )


register_opaque_type(RingPlan, typ="reference")
PLAN_TYPE = get_opaque_type_name(RingPlan)  # its name in an op's schema


def plan_for(
    ring: Ring, geometry: CallGeometry, attn_mask, program: str, inputs: list[torch.Tensor],
    transport: Transport | None = None,
) -> RingPlan:  # fmt: skip
    """A new plan of calls of ``geometry`` on ``ring`` (their tile size: the device's,
    ``tiles.tiles_per_chunk``), K/V reaching their queries by ``transport`` (the ring's)."""
    transport = transport or Transport(ring.size)
    if transport.size != ring.size:
        raise ValueError(f"a transport over {transport.size} ranks for a ring of {ring.size}")
    if attn_mask is not None:  # a mask tensor: its tiles are the call's own
        home = _home(ring, geometry, attn_mask, program)
        args = (attn_mask, geometry.is_causal, geometry.key_len, "", [])
        masks = TileMasks(home, ring.size, *args)
        return RingPlan(home, home, masks, None, geometry)
    # the plan keeps copies of its own: the plan op's inputs are host tensors already, but
    # Inductor may reuse their buffers once the op has run
    host = host_copy(inputs)
    # what the device's tiles and calls are (tests switch an accelerator's on for CPU tensors)
    site = key = (geometry, tiles.on_accelerator(geometry.device_type), transport, program)
    if host:  # decided from the inputs' values, which a recorded graph's replay must have
        key = _content_key(site, host)
        check_captured(site, key)
    if key not in _layouts:
        _layouts.keep(key, _decided(ring, geometry, program, host, transport))
    return RingPlan(*_layouts.get(key), geometry, transport, key=(site, key) if host else None)


def _decided(ring: Ring, g: CallGeometry, program: str, host, transport: Transport) -> tuple:
    """``(home, queries, masks, balanced)``: what a plan decides on the host."""
    if not transport.is_ring:
        return _over_heads(ring, g, program, host, transport.heads_group)
    home = _program_home(ring, g, program, host)
    varlen = tiles.on_accelerator(g.device_type)  # FA2 varlen calls for open pairs (GPU tiles)
    masks = TileMasks(home, ring.size, None, g.is_causal, g.key_len, program, host, varlen)
    if not (program and g.balance and ring.size > 1):
        return home, home, masks, None
    queries = balanced_tiling(masks, min_gain_area(g.device_type))
    if queries is None:
        return home, home, masks, False
    return home, queries, masks.working_on(queries), True


def _over_heads(ring: Ring, g: CallGeometry, program: str, host, u: int) -> tuple:
    """What a call decides whose all-to-all spans groups of ``u`` ranks: the plan of a ring of
    the P / u groups (one rank's, over every row, where u = P), group j holding every row of
    its ranks' shards side by side, in rank order, as the all-to-all lays them (a mask that
    differs per head is cut to each rank's share of them: ``CallMasks``)."""
    home, rows = _program_home(ring, g, program, host), g.rows

    @functools.cache
    def group_rows(j: int) -> list[Tile]:
        return [
            Tile(slice(t.rows.start + m * rows, t.rows.stop + m * rows), t.key, t.start)
            for m in range(u)
            for t in home(j * u + m)
        ]

    varlen = tiles.on_accelerator(g.device_type)
    groups = ring.size // u
    masks = TileMasks(group_rows, groups, None, g.is_causal, g.key_len, program, host, varlen)
    return group_rows, group_rows, masks, None


def _program_home(ring: Ring, g: CallGeometry, program: str, host) -> Tiling:
    """Every rank's tiles under ``program`` (finer where it leaves each query a short span of
    keys, unless the call forced a tiling), or with no program."""
    if program and not g.tiles_per_chunk:
        per_chunk = program_tiles_per_chunk(
            program, host, g.rows, ring.size, g.layout, g.device_type
        )
        g = dataclasses.replace(g, tiles_per_chunk=per_chunk)
    return _home(ring, g, None, program)


def _home(ring: Ring, g: CallGeometry, attn_mask, program: str) -> Tiling:
    masked = attn_mask is not None or bool(program)
    positional = needs_positions(masked, g.is_causal, g.key_len, g.rows * ring.size)
    args = (ring.size, g.rows, g.layout, positional, g.tiles_per_chunk, g.device_type)

    @functools.cache  # asked at every step of every call: the same tiles each time
    def home(rank: int):
        return shard_tiles(rank, *args)

    return home


class _Memo:
    """The last ``MAX_LAYOUTS`` host-side answers, by content: a memo of a pure function."""

    def __init__(self) -> None:
        self._entries: OrderedDict = OrderedDict()

    def __contains__(self, key) -> bool:
        return key in self._entries

    def keep(self, key, value) -> None:
        self._entries[key] = value
        while len(self._entries) > MAX_LAYOUTS:
            self._entries.popitem(last=False)

    def get(self, key):
        self._entries.move_to_end(key)
        return self._entries[key]


_layouts = _Memo()


def _content_key(key: tuple, host: list[torch.Tensor]) -> int:
    """``key`` and the inputs' shapes, dtypes and bytes, hashed (the inputs are host copies)."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=16)
    for x in host:
        digest.update(repr((tuple(x.shape), x.dtype)).encode())
        digest.update(x.reshape(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(digest.digest(), "little")


# Its inputs' values decide: Inductor runs it outside any CUDA graph (``captures.py``).
@torch.library.custom_op(
    "ringify::attention_plan",
    mutates_args=(),
    tags=(torch.Tag.cudagraph_unsafe,),
    schema=(  # written out: an optional opaque argument is beyond ``infer_schema``
        "(str mask_program, Tensor[] mask_inputs, SymInt rows, bool is_causal, str group_name, "
        "str layout, SymInt key_len, int tiles_per_chunk=0, bool balance=True, "
        f"{TRANSPORT_TYPE}? transport=None, str device_type='') -> {PLAN_TYPE}"
    ),
)
def attention_plan(
    mask_program: str,
    mask_inputs: list[torch.Tensor],
    rows: int,
    is_causal: bool,
    group_name: str,
    layout: str,
    key_len: int,
    tiles_per_chunk: int = 0,
    balance: bool = True,
    transport: Transport | None = None,
    device_type: str = "",
) -> RingPlan:
    """The plan of every ring call under this program with these inputs (for a call with no
    program, of every call of this geometry); the ring ops take it as their ``plan``. The
    graph gives it ``mask_inputs`` on the host (``captures.py``) and names the
    ``device_type`` its ring calls run on."""
    ring = ring_by_name(group_name)
    device_type = device_type or _device_type(ring, mask_inputs)
    geometry = CallGeometry(
        group_name, ring.size, rows, is_causal, layout, key_len, tiles_per_chunk, balance,
        device_type,
    )  # fmt: skip
    return plan_for(ring, geometry, None, mask_program, mask_inputs, transport)


def _device_type(ring: Ring, inputs: list[torch.Tensor]) -> str:
    """The device the ring calls of this plan run on, for its tile size, where no one named
    it: the program inputs', else CUDA where the ring's backend moves CUDA tensors and there
    is a GPU."""
    if inputs:
        return inputs[0].device.type
    served = served_devices(ring) if ring.group is not None else set()
    return "cuda" if "cuda" in served and torch.cuda.is_available() else "cpu"


@attention_plan.register_fake
def _(mask_program, mask_inputs, rows, is_causal, group_name, layout, key_len, *options):
    return RingPlan.unbuilt()
