"""How a call's K/V, their gradients and its query rows travel: the seam between the ring
op's loop and the network.

The loop (``ops.py``) attends each query tile to the K/V tiles it holds at each visit and
merges the blocks; what it holds, and where its rows come from and go back to, is the
transport's, chosen by the plan (``masks/call_plan.py``). Both expose the same members, so the
loop is written once:

- ``P2PRing``: K/V tiles travel round the ring, one step per visit (``tiles.ring_visits``).
  In the backward the gradient of each tile travels with it: every rank that holds the
  tile adds its queries' share and passes the sum on; at the tile's last step (the
  farthest rank whose queries see it) the sum goes straight home. ``GradTrip`` is that
  protocol for one sub-ring: ``arrived`` waits for the exchange of the step before and
  gives what travels in, ``go_on`` sends this rank's sum on or home and posts the next
  step's receives, so that an exchange is in flight while the next tiles' blocks run.
  A balanced plan (``masks/balance.py``) leaves every tile that stays on a rank in its own
  rows, so the op reads its inputs as ``ShardRows``: the tensor itself, except for the
  moved-in tiles, read from receive buffers the size of those tiles; results go home in
  place (``move_home``). A plan costs the moved rows, not a copy of every buffer.
- ``AllToAll`` (DeepSpeed-Ulysses): one all-to-all gives each rank every row of its share of
  the heads (``collectives/heads.py``); the loop then runs on a one-rank ring over the whole
  sequence, and the results, dq, dk and dv go back with a second all-to-all. GQA's K/V heads
  are repeated only as far as the ring needs (``kv_repeats``), their gradients summed back.
  The hybrid (USP) is the same class with the all-to-all inside groups of u consecutive
  ranks and the loop on the ring of the P / u groups (the ranks with this one's place in
  theirs), whose K/V travel as P2PRing's do.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch

from ringify.runtime.collectives.heads import kv_repeats, to_heads, to_sequence
from ringify.runtime.collectives.ring import (
    LOCAL,
    Courier,
    Delivery,
    Parcel,
    Ring,
    ring_by_name,
    strided_ring_name,
    sub_ring_name,
)
from ringify.runtime.masks.call_plan import RingPlan
from ringify.runtime.tiling.tiles import SubRing, Tiling, ring_visits, sequence_rows


class P2PRing:
    """K/V round the ring (``ring``), under ``plan``."""

    def __init__(self, ring: Ring, plan: RingPlan) -> None:
        self.ring, self.plan = ring, plan

    @property
    def mine(self) -> list:
        """The query tiles this rank works on."""
        return self.plan.queries(self.ring.rank)

    def queries_in(self, tensors: list[torch.Tensor]) -> list[ShardRows]:
        """Per-query-row tensors (q, and in the backward dout, out, lse) as the loop reads them."""
        return rows_in(self.ring, tensors, self.plan.home, self.plan.queries)

    def keys_in(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v

    @property
    def head_share(self) -> tuple[int, int]:
        """``(i, n)``: this rank attends with the i-th of n equal shares of the heads: all."""
        return 0, 1

    def visits(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[tuple]:
        """``(own, step, src, held, kv)`` per visit (``tiles.ring_visits``)."""
        return ring_visits(self.ring, k, v, self.plan.home, self.plan.masks.last_steps)

    def grad_trip(self, own, k, v, dk, dv, acc) -> GradTrip:
        """The dK/dV trip of sub-ring ``own``'s tiles, from its first visit."""
        last = self.plan.masks.last_steps(own.tiles[0].sub_ring)
        return GradTrip(self.ring, own, last, k, v, dk, dv, acc)

    def queries_home(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The per-query-row results (out, lse; dq) back in the shard's own rows."""
        move_home(self.ring, tensors, self.plan.queries, self.plan.home)
        return tensors

    def keys_home(self, dk: torch.Tensor, dv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return dk, dv


class AllToAll(P2PRing):
    """Every row of this rank's heads in ``group`` by all-to-all, K/V then round ``across``
    (a one-rank ring where ``group`` is the whole ring), under ``plan``, a plan of ``across``
    whose ranks hold their groups' rows. ``heads``/``kv_heads``: q's and K/V's."""

    def __init__(
        self, group: Ring, across: Ring, plan: RingPlan, heads: int, kv_heads: int
    ) -> None:
        super().__init__(across, plan)
        self.group = group
        self.repeats = kv_repeats(heads, kv_heads, group.size)
        if self.repeats is None:
            raise ValueError(
                f"the all-to-all transport gives each of the {group.size} ranks a share of the "
                f"{heads} query heads, which they do not divide; use the ring for this "
                "attention"
            )

    def queries_in(self, tensors: list[torch.Tensor]) -> list[ShardRows]:
        return super().queries_in([to_heads(x, self.group) for x in tensors])

    def keys_in(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.repeats > 1:
            k, v = (x.repeat_interleave(self.repeats, dim=1) for x in (k, v))
        return to_heads(k, self.group), to_heads(v, self.group)

    @property
    def head_share(self) -> tuple[int, int]:
        return self.group.rank, self.group.size  # ``to_heads``: rank r keeps the r-th share

    def queries_home(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [to_sequence(x, self.group) for x in tensors]

    def keys_home(self, dk: torch.Tensor, dv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dk, dv = to_sequence(dk, self.group), to_sequence(dv, self.group)
        if self.repeats == 1:
            return dk, dv
        b, h, s, d = dk.shape
        r = self.repeats
        return tuple(x.view(b, h // r, r, s, d).sum(2) for x in (dk, dv))


def transport_for(ring: Ring, plan: RingPlan, q: torch.Tensor, k: torch.Tensor) -> P2PRing:
    """The plan's transport for a call of ``q`` and ``k`` on ``ring``."""
    u = plan.transport.heads_group
    if u == 1:
        return P2PRing(ring, plan)
    group = ring_by_name(sub_ring_name(ring, u))
    across = ring_by_name(strided_ring_name(ring, u) if u < ring.size else LOCAL)
    return AllToAll(group, across, plan, q.shape[1], k.shape[1])


class ShardRows:
    """A shard tensor (rows on dim 2) laid out by another tiling: ``rows[r]`` is local rows
    ``r`` (within one tile), from the tensor for a tile that stayed, else from the buffer
    its rows were received into. Each view is made once (every held tile's blocks read the
    same query rows: one slice each, not one per block)."""

    def __init__(self, tensor: torch.Tensor, moved_in: list[tuple[slice, torch.Tensor]] = ()):
        self.tensor = tensor
        self._moved_in = list(moved_in)  # (slot rows, buffer)
        self._views: dict[tuple[int, int, bool], torch.Tensor] = {}  # by rows, FA2's layout

    def __getitem__(self, rows: slice) -> torch.Tensor:
        key = (rows.start, rows.stop, False)
        if key not in self._views:
            self._views[key] = self._view(rows)
        return self._views[key]

    def sequence(self, rows: slice) -> torch.Tensor:
        """Local rows ``rows`` as FA2's varlen (rows, H, D) of a batch of one: one view op,
        made once, as ``rows[r]``."""
        key = (rows.start, rows.stop, True)
        if key not in self._views:
            x, start = self._source(rows)
            self._views[key] = sequence_rows(x, start, rows.stop - rows.start)
        return self._views[key]

    def _view(self, rows: slice) -> torch.Tensor:
        x, start = self._source(rows)
        if start == 0 and rows.stop - rows.start == x.shape[2]:
            return x  # a whole buffer, or a call over all the shard's rows: no view to launch
        return x.narrow(2, start, rows.stop - rows.start)

    def _source(self, rows: slice) -> tuple[torch.Tensor, int]:
        """The tensor holding local rows ``rows`` (a buffer they were received into, or the
        shard's own) and where in it they start."""
        for slot, buffer in self._moved_in:
            if slot.start <= rows.start < slot.stop:
                assert rows.stop <= slot.stop, (rows, slot)
                return buffer, rows.start - slot.start
        return self.tensor, rows.start

    def moved_rows(self) -> int:
        return sum(slot.stop - slot.start for slot, _ in self._moved_in)


def rows_in(ring: Ring, tensors: list[torch.Tensor], home: Tiling, plan: Tiling) -> list:
    """``tensors`` (laid out by ``home``) as laid out by ``plan``: each a ``ShardRows``; the
    rows of the tiles that move to this rank are received, nothing else is copied."""
    if plan is home:
        return [ShardRows(x) for x in tensors]
    slots, received = _exchange(ring, tensors, home, plan)
    return [
        ShardRows(x, [(rows, parts[i]) for rows, parts in zip(slots, received, strict=True)])
        for i, x in enumerate(tensors)
    ]


def move_home(ring: Ring, tensors: list[torch.Tensor], plan: Tiling, home: Tiling) -> None:
    """Lay ``tensors`` out by ``home`` in place, from ``plan``: the rows of the tiles that
    moved are sent back and their own rows received into the slots they leave (through
    buffers: those slots are the ones sent from)."""
    if plan is home:
        return
    slots, received = _exchange(ring, tensors, plan, home)
    for rows, parts in zip(slots, received, strict=True):
        for x, part in zip(tensors, parts, strict=True):
            narrow_rows(x, rows).copy_(part)


def _exchange(ring: Ring, tensors, src: Tiling, dst: Tiling):
    """Send the rows of this rank's tiles that ``dst`` puts elsewhere; receive those that
    ``dst`` puts here from elsewhere: ``(their local rows under dst, received buffers)``,
    waited for (the sends too, so their slots may be written next)."""
    sends, receives = _moves(src, dst, ring.rank, ring.size)
    courier = Courier(ring, Parcel.QUERY_ROWS)
    for peer, rows in sends:
        courier.send(peer, [_wire(narrow_rows(x, rows)) for x in tensors])
    for i, (peer, rows) in enumerate(receives):  # buffers shaped from the sizes: no view
        courier.receive_into(
            str(i), peer, [_wire_buffer(x, rows.stop - rows.start) for x in tensors]
        )
    delivery = courier.start()
    arrived = delivery.wait() if delivery is not None else {}
    received = [[_unwire(b) for b in arrived[str(i)]] for i in range(len(receives))]
    return [rows for _, rows in receives], received


def _wire(x: torch.Tensor) -> torch.Tensor:
    """Rows (dim 2) as they travel, in one order on every rank whatever its strides: a
    (B, H, S, D) tensor sequence-major, (rows, B, H, D), as K/V tiles travel: a view that is
    dense where the tensor is a model's (B, S, H, D) with B = 1, so nothing is copied
    (``start_exchange`` makes any other dense); a tensor of other dims as it is."""
    return x.permute(2, 0, 1, 3) if x.dim() == 4 else x


def _unwire(buffer: torch.Tensor) -> torch.Tensor:
    """A received ``_wire`` buffer as the rows it carries."""
    return buffer.permute(1, 2, 0, 3) if buffer.dim() == 4 else buffer


def _wire_buffer(x: torch.Tensor, n: int) -> torch.Tensor:
    """An empty receive buffer for ``n`` rows of ``x``, in its wire order."""
    shape = (*x.shape[:2], n, *x.shape[3:])
    if x.dim() == 4:
        shape = (n, *x.shape[:2], x.shape[3])
    return x.new_empty(shape)


def narrow_rows(x: torch.Tensor, rows: slice) -> torch.Tensor:
    """Rows ``rows`` (dim 2) of ``x``."""
    return x.narrow(2, rows.start, rows.stop - rows.start)  # one view op, where [:, :, r] is two


@functools.lru_cache(maxsize=256)  # the same for every call of a plan
def _moves(src: Tiling, dst: Tiling, rank: int, size: int) -> tuple[list, list]:
    """``(sends, receives)`` of rank ``rank`` from tiling ``src`` to ``dst``, each a list of
    (peer, local rows: under ``src`` for a send, under ``dst`` for a receive). Every rank
    works out the same moves, in the order their senders send them; tiles that lie side by
    side on both ranks, in the same order, travel as one."""
    at_dst = {t.key: (r, t.rows) for r in range(size) for t in dst(r)}
    moved = sorted(  # (from, to, rows at the sender, rows at the receiver), in sending order
        [(r, at_dst[t.key][0], t.rows, at_dst[t.key][1]) for r in range(size) for t in src(r)],
        key=lambda m: (m[0], m[1], m[2].start),
    )
    runs: list[list] = []
    for a, b, here, there in moved:
        if a == b:  # stays
            continue
        last = runs[-1] if runs else None
        if (
            last
            and last[:2] == [a, b]
            and (last[2].stop, last[3].stop) == (here.start, there.start)
        ):
            last[2], last[3] = slice(last[2].start, here.stop), slice(last[3].start, there.stop)
        else:
            runs.append([a, b, here, there])
    sends = [(b, here) for a, b, here, _ in runs if a == rank]
    receives = [(a, there) for a, b, _, there in runs if b == rank]
    return sends, receives


class GradTrip:
    """The trip of one sub-ring's dK/dV on ``ring``: this rank's tiles ``own``, which each
    rank's tiles travel as far as step ``last[rank]``; ``dk`` and ``dv`` (``RowSum``) take
    this rank's own tiles' sums when they arrive home, in ``acc``."""

    def __init__(self, ring: Ring, own: SubRing, last: list[int], k, v, dk, dv, acc) -> None:
        self.ring, self.last, self.slots = ring, last, GradSlots(own, k, v)
        self._dk, self._dv, self._acc = dk, dv, acc
        self._delivery: Delivery | None = None

    def arrived(self, step: int) -> list[torch.Tensor] | None:
        """The dK/dV travelling in at ``step`` (None at step 0, or where none comes), once
        the step before's exchange is done; what it brought home is stored."""
        arrived = self._wait()
        return arrived.get("travel") if step > 0 else None

    def go_on(self, step: int, src: int, dkv: list[torch.Tensor] | None) -> None:
        """Pass on ``dkv``, the sum for the tiles of rank ``src`` held at ``step`` (None where
        none are held): to the next rank, or home at their last step; and receive what the
        next step brings. The trip's last step waits for its exchange."""
        ring, last = self.ring, self.last
        if dkv is not None and step == last[src] == 0:  # seen only at home
            self.slots.store_home(dkv, self._dk, self._dv)
        courier = Courier(ring, Parcel.DKV)
        if dkv is not None and step < last[src]:
            courier.send(courier.peer(1), dkv)
        elif dkv is not None and step == last[src] > 0:
            courier.send(src, dkv)
        if step + 1 <= last[courier.peer(-step - 1)]:
            courier.receive_into("travel", courier.peer(-1), self.slots.buffers(self._acc))
        if step == last[ring.rank] > 0:
            courier.receive_into("home", courier.peer(step), self.slots.buffers(self._acc))
        self._delivery = courier.start()
        if step == ring.size - 1:  # the trip ends here
            self._wait()

    def _wait(self) -> dict[str, list[torch.Tensor]]:
        arrived = self._delivery.wait() if self._delivery is not None else {}
        self._delivery = None
        if "home" in arrived:
            self.slots.store_home(arrived["home"], self._dk, self._dv)
        return arrived


class GradSlots:
    """Where the dK/dV of a sub-ring's tiles accumulate, and so how they travel: one slot for
    K and one for V, every tile side by side, where the tiles are adjacent rows (as K/V then
    travel, on every rank); else one slot per tile, K tiles then V tiles."""

    def __init__(self, own: SubRing, k, v):
        self.joined, self._own, self._kv = own.adjacent, own.tiles, (k, v)
        self.starts = own.starts
        rows = [self.starts[-1]] if self.joined else [t.length for t in self._own]
        self.shapes = [(*x.shape[:2], r, x.shape[3]) for x in (k, v) for r in rows]

    def at(self, which: int, tile: int, cols: slice) -> tuple[int, slice]:
        """The slot and its key rows of K (0) or V (1) at ``cols`` of held tile ``tile``'s keys
        (``cols`` may run on into the tiles after it, where they are side by side)."""
        if not self.joined:
            return which * len(self._own) + tile, cols
        start = self.starts[tile]
        return which, slice(start + cols.start, start + cols.stop)

    def parts(self, which: int, b) -> list[tuple[int, slice, slice | None]]:
        """``(slot, its key rows, the block's key rows or None for all)`` for K (0) or V (1)
        of block ``b``: one slot where the tiles are joined, else one per tile the block's
        keys reach (side by side, they may start inside the first and stop inside the last)."""
        if self.joined or b.tiles == 1:
            return [(*self.at(which, b.held, b.cols), None)]
        first = self.starts[b.held] + b.cols.start
        end = self.starts[b.held] + b.cols.stop
        parts = []
        for t in range(b.held, b.held + b.tiles):
            lo, hi = max(first, self.starts[t]), min(end, self.starts[t + 1])
            if lo < hi:
                slot, rows = self.at(which, t, slice(lo - self.starts[t], hi - self.starts[t]))
                parts.append((slot, rows, slice(lo - first, hi - first)))
        return parts

    def buffers(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """New dense receive buffers, one per slot."""
        device = self._kv[0].device
        return [torch.empty(shape, dtype=dtype, device=device) for shape in self.shapes]

    def store_home(self, totals: list[torch.Tensor], dk, dv) -> None:
        """This rank's own tiles' dK and dV, complete (``totals``, one per slot): added into
        ``dk`` and ``dv`` (``attention/protocol.py``'s ``RowSum``: each row arrives once)."""
        if self.joined:
            rows = slice(self._own[0].rows.start, self._own[0].rows.start + self.starts[-1])
            dk.add(rows, totals[0])
            dv.add(rows, totals[1])
            return
        n = len(self._own)
        for t, dk_home, dv_home in zip(self._own, totals[:n], totals[n:], strict=True):
            dk.add(t.rows, dk_home)
            dv.add(t.rows, dv_home)
