"""Rows of a shard between its own tiling and a balanced one (``masks/balance.py``), with no
copy of the shard.

A balanced plan leaves every tile that stays on a rank in its own local rows; only
the slots of tiles that change rank change content. So the op reads its inputs in
the plan's layout as ``ShardRows``: the tensor itself, except for the moved-in tiles,
read from receive buffers the size of those tiles. Its results go back home in place
(``move_home``): only the moved tiles' rows are sent and received. The memory a plan
costs is the moved rows, not a copy of every buffer.
"""

from __future__ import annotations

import functools

import torch

from ringify.runtime.collectives.courier import Courier, Parcel
from ringify.runtime.collectives.ring import Ring
from ringify.runtime.tiling.tiles import Tiling


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


def sequence_rows(x: torch.Tensor, start: int, length: int, rows_dim: int = 2) -> torch.Tensor:
    """Rows ``start`` to ``start + length`` of a batch of one, ``x`` (1, H, S, D), or with
    ``rows_dim`` 0 a sequence-major (S, 1, H, D) buffer, as FA2's varlen layout (rows, H, D):
    one ``as_strided`` whatever the strides (a narrow and a transpose would be three view
    ops, each a dispatch on a GPU's host)."""
    heads_dim = 1 if rows_dim == 2 else 2
    stride = x.stride()
    return x.as_strided(
        (length, x.shape[heads_dim], x.shape[3]),
        (stride[rows_dim], stride[heads_dim], stride[3]),
        x.storage_offset() + start * stride[rows_dim],
    )


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
