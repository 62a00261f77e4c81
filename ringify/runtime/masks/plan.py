"""A ring call's plan: what the op decides from its mask before touching q, k or v, made once.

Under a mask program, the op decides from the program and its O(S) inputs: the tiling
(finer under a window), each tile pair's visibility and each open pair's blocks, how far
each K/V tile travels, and the balanced assignment of query tiles. Every layer of a model
asks the same question with the same inputs, in its forward and again in its backward;
FlexAttention answers it once per step with one ``BlockMask``. So does this:

- ``plan_for`` copies the program's inputs to the host in one copy (the only device-to-
  host read of a plan) and builds the plan there, where every decision reads host
  tensors for free and none is mixed with a device tensor;
- plans are kept by content (the geometry, the program's text and the inputs' bytes),
  so a plan is built once for the inputs it serves, and a model whose mask does not
  change between steps (no padding, a fixed packing) builds it once;
- the graph pass emits one ``ringify::attention_plan`` node per distinct program and its
  inputs, before the first layer; its output, a handle to the plan, is an input of every
  ring op that runs under that program, forward and backward (saved for the backward,
  and so for a checkpoint's recompute). The ring op finds the plan by the handle tensor
  itself (a weak key: the plan lives as long as the handle, and nothing is read from it),
  so it reads no device tensor at all; one given no handle it knows (the public op, called
  directly) makes or finds its plan by content, at one read.
"""

from __future__ import annotations

import functools
import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from ringify.runtime.collectives.ring import Ring, ring_by_name, served_devices
from ringify.runtime.masks.balance import balanced_tiling, count_plan, min_gain_area
from ringify.runtime.masks.handles import HandleMap
from ringify.runtime.masks.pair_bounds import program_tiles_per_chunk
from ringify.runtime.masks.tile_masks import TileMasks
from ringify.runtime.tiling import tiles
from ringify.runtime.tiling.schedule import needs_positions, shard_tiles
from ringify.runtime.tiling.tiles import Tiling

# Plans kept, most recently used last: a model has a few programs, each step one plan each.
MAX_PLANS = 32

_lookups: Counter = Counter()  # how calls found their plans (``plan_lookups``)
_plans: OrderedDict[int | tuple, Plan] = OrderedDict()  # by content, or by geometry alone
_handles = HandleMap()  # by the handle an attention_plan made


@dataclass(frozen=True)
class Plan:
    """How one call runs: ``home(rank)`` tiles that rank's shard (its K/V tiles travel so),
    ``queries(rank)`` the query tiles it works on (``home`` unless balanced), ``masks``
    every pair's visibility. ``balanced``: None where balancing does not apply.
    ``geometry``: the ring, rows and options it was made for; ``handle``: its key."""

    home: Tiling
    queries: Tiling
    masks: TileMasks
    balanced: bool | None
    geometry: tuple
    handle: int


def plan_for(
    ring: Ring, rows: int, attn_mask, is_causal: bool, layout: str, key_len: int,
    program: str, inputs: list[torch.Tensor], per_chunk: int, balance: bool,
    handle: torch.Tensor | None = None, device_type: str = "cpu",
) -> Plan:  # fmt: skip
    """The plan of a call on ``device_type`` (its tile size, ``tiles.tiles_per_chunk``): the one
    ``handle`` names, if it is still kept and was made for this geometry; else the kept
    plan of the same content; else a new one."""
    geometry = (ring.name, ring.size, rows, is_causal, layout, key_len, per_chunk, balance)
    geometry += (device_type,)
    if attn_mask is not None:  # a mask tensor: its tiles are the call's own
        home = _home(ring, geometry, attn_mask, program)
        masks = TileMasks(home, ring.size, attn_mask, is_causal, key_len, program, [])
        return Plan(home, home, masks, None, geometry, 0)
    # what the device's tiles and calls are (tests switch an accelerator's on for CPU tensors)
    sized = (*geometry, tiles.on_accelerator(device_type))
    if not program:  # nothing to read: kept by geometry alone
        if sized not in _plans:
            home = _home(ring, geometry, None, "")
            masks = TileMasks(home, ring.size, None, is_causal, key_len, "", [])
            _keep(sized, Plan(home, home, masks, None, geometry, 0))
        return _used(sized)
    if handle is not None:
        kept = _handles.get(handle)  # the handle tensor itself is the key: nothing is read
        # made for this geometry (a plan made for another device's tile size is still exact)
        if kept is not None and kept.geometry[:-1] == geometry[:-1]:
            _lookups["by handle"] += 1
            return kept
    host = _host_copy(inputs)
    _lookups["host copies"] += bool(inputs)
    key = _content_key(sized, program, host)
    if key not in _plans:
        _keep(key, _build(ring, geometry, program, host, key))
        _lookups["built"] += 1
    return _used(key)


def _keep(key: int | tuple, plan: Plan) -> None:
    _plans[key] = plan
    while len(_plans) > MAX_PLANS:
        _plans.popitem(last=False)


def _used(key: int | tuple) -> Plan:
    _plans.move_to_end(key)
    return _plans[key]


def plan_lookups() -> dict[str, int]:
    """Since the last ``reset_plan_lookups``: the plans found by a handle (no read), the
    host copies of program inputs (one device read each), and the plans built."""
    return {k: _lookups[k] for k in ("by handle", "host copies", "built")}


def reset_plan_lookups() -> None:
    _lookups.clear()


def _build(ring: Ring, geometry: tuple, program: str, host: list[torch.Tensor], key: int) -> Plan:
    _, _, rows, is_causal, layout, key_len, per_chunk, balance, device_type = geometry
    if not per_chunk:
        per_chunk = program_tiles_per_chunk(program, host, rows, ring.size, layout, device_type)
    home = _home(ring, (*geometry[:6], per_chunk, *geometry[7:]), None, program)
    varlen = tiles.on_accelerator(device_type)  # FA2 varlen calls for open pairs (GPU tiles)
    masks = TileMasks(home, ring.size, None, is_causal, key_len, program, host, varlen)
    if not (balance and ring.size > 1):
        return Plan(home, home, masks, None, geometry, key)
    queries = balanced_tiling(masks, min_gain_area(device_type))
    if queries is None:
        return Plan(home, home, masks, False, geometry, key)
    return Plan(home, queries, masks.working_on(queries), True, geometry, key)


def _home(ring: Ring, geometry: tuple, attn_mask, program: str) -> Tiling:
    _, _, rows, is_causal, layout, key_len, per_chunk, _, device_type = geometry
    masked = attn_mask is not None or bool(program)
    positional = needs_positions(masked, is_causal, key_len, rows * ring.size)

    @functools.cache  # asked at every step of every call: the same tiles each time
    def home(rank: int):
        return shard_tiles(rank, ring.size, rows, layout, positional, per_chunk, device_type)

    return home


def count_call(plan: Plan) -> None:
    """Count a call's use of its plan (``balance.plan_counts``)."""
    if plan.balanced is not None:
        count_plan(plan.balanced)


def _host_copy(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The inputs on the host, in one device-to-host read (their bytes side by side)."""
    if not inputs:
        return []
    inputs = [x.detach().contiguous() for x in inputs]
    raw = torch.cat([x.reshape(-1).view(torch.uint8) for x in inputs])
    raw = torch.from_numpy((raw if raw.device.type == "cpu" else raw.cpu()).numpy())
    host, start = [], 0
    for x in inputs:
        size = x.numel() * x.element_size()
        host.append(raw[start : start + size].clone().view(x.dtype).view(x.shape))  # aligned
        start += size
    return host


def _content_key(geometry: tuple, program: str, host: list[torch.Tensor]) -> int:
    digest = hashlib.blake2b(repr((geometry, program)).encode(), digest_size=8)
    for x in host:
        digest.update(repr((tuple(x.shape), x.dtype)).encode())
        digest.update(x.reshape(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(digest.digest(), "little") >> 1  # an int64


@torch.library.custom_op("ringify::attention_plan", mutates_args=())
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
) -> torch.Tensor:
    """A handle (a host int64 tensor of one element) to the plan of every ring call under
    this program with these inputs; the ring ops take it as their ``plan``."""
    ring = ring_by_name(group_name)
    args = (None, is_causal, layout, key_len, mask_program, mask_inputs, tiles_per_chunk, balance)
    plan = plan_for(ring, rows, *args, device_type=_device_type(ring, mask_inputs))
    handle = torch.tensor([plan.handle], dtype=torch.int64)  # its content key, never read
    _handles[handle] = plan
    return handle


def _device_type(ring: Ring, inputs: list[torch.Tensor]) -> str:
    """The device the ring calls of this plan run on, for its tile size: the program
    inputs', else CUDA where the ring's backend moves CUDA tensors and there is a GPU."""
    if inputs:
        return inputs[0].device.type
    served = served_devices(ring) if ring.group is not None else set()
    return "cuda" if "cuda" in served and torch.cuda.is_available() else "cpu"


@attention_plan.register_fake
def _(mask_program, mask_inputs, rows, is_causal, group_name, layout, key_len, tiles=0, bal=True):
    return torch.empty(1, dtype=torch.int64, device="cpu")
