"""The ring a call runs on, and the one seam through which the ring op's tensors travel.

Custom ops cannot take a ``ProcessGroup`` argument, so a group travels as its name (``""``
means "no ring": torch.distributed is not initialised or the group has one rank), as
``torch.distributed._functional_collectives`` does; ``ring_by_name`` resolves it.

Three things travel between ranks: K/V tiles round the ring (forward and backward), their
dK/dV going on with them and then home, and the query rows a balanced plan moves. Each is a
``Parcel``, whose value is its P2P tag: the tag keeps concurrent transfers apart on gloo,
which matches by tag; NCCL matches a pair's operations in issue order, which every rank
keeps (the ring's steps, and within a step the order of ``send`` and ``receive``). A
``Courier`` collects one exchange's sends and named receives and ``start``s them as one
batch (``start_exchange``: the same code for NCCL and gloo); its ``Delivery`` is waited for
after the block it overlaps, and gives each receive by its name (torch's ``_RingRotater``
hides its transport the same way, behind ``exchange_buffers`` and ``next_buffer``).
``SentBytes`` counts what a process sends.
"""

from __future__ import annotations

import contextvars
import enum
import hashlib
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.distributed_c10d import _resolve_process_group

LOCAL = ""


@dataclass(frozen=True)
class Ring:
    """A resolved ring: the group, this rank's place in it, and its size."""

    group: dist.ProcessGroup | None
    rank: int
    size: int

    @property
    def name(self) -> str:
        return LOCAL if self.group is None else self.group.group_name

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)


def resolve_ring(group: dist.ProcessGroup | None) -> Ring:
    """The ring for ``group`` (``None``: the default group), or a local one-rank ring."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        hint = (
            " (for a DeviceMesh, pass ringify(..., mesh=mesh[dim_name]) or mesh.get_group(dim_name))"
            if hasattr(group, "get_group")
            else ""
        )
        raise TypeError(
            "group must be a torch.distributed.ProcessGroup, or None for the default group; "
            f"got {type(group).__name__}{hint}"
        )
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError(
                "a process group was passed but torch.distributed is not initialised; "
                "call torch.distributed.init_process_group() first or pass group=None"
            )
        return Ring(None, 0, 1)
    group = dist.group.WORLD if group is None else group
    size = dist.get_world_size(group)
    if size == 1:
        return Ring(None, 0, 1)
    return Ring(group, dist.get_rank(group), size)


# Process-wide, as c10d's own registry of groups is: a sub-group is made once, by a
# collective of its members, and every later call finds it by (ring, size).
_sub_rings: dict[tuple[str, int], str] = {}


def sub_ring_name(ring: Ring, size: int) -> str:
    """The name of the group of ``size`` consecutive ranks of ``ring`` this rank belongs to.

    Created on first use by the member ranks only (local synchronisation), so every
    block of ranks builds its own group independently; cached per (ring, size).
    """
    if size == 1:
        return LOCAL
    if size == ring.size:
        return ring.name
    first = ring.rank // size * size
    return _group_name(ring, (ring.name, size), range(first, first + size))


def strided_ring_name(ring: Ring, stride: int) -> str:
    """The name of the group of ``ring``'s ranks whose place in their block of ``stride``
    consecutive ranks is this rank's (one of each block, in rank order): the ring across
    ``sub_ring_name(ring, stride)``'s groups. Created and cached as that is."""
    members = range(ring.rank % stride, ring.size, stride)
    return _group_name(ring, (ring.name, -stride), members)


def _group_name(ring: Ring, key: tuple, members: range) -> str:
    """The name of the group of ``ring``'s ranks ``members``, made by them alone on first use
    (local synchronisation) and kept by ``key``."""
    if key not in _sub_rings:
        ranks = [ring.global_rank(r) for r in members]
        _sub_rings[key] = dist.new_group(ranks, use_local_synchronization=True).group_name
    return _sub_rings[key]


def ranks_per_host(ring: Ring, device: torch.device) -> int:
    """How many consecutive ranks of ``ring`` share each host: the ring's size where all do,
    1 where the hosts do not hold equal blocks of consecutive ranks. A collective of one
    host id per rank, on ``device`` (so that NCCL needs no current device set; outside any
    fake mode the caller traces under): every rank of the ring calls it."""
    if ring.group is None:
        return 1
    host = int.from_bytes(hashlib.sha1(socket.gethostname().encode()).digest()[:7], "little")
    with unset_fake_temporarily():
        gathered = torch.empty(ring.size, dtype=torch.int64, device=device)
        mine = torch.tensor([host], dtype=torch.int64, device=device)
        dist.all_gather_single(gathered, mine, group=ring.group)
        hosts = gathered.tolist()
    u = hosts.count(hosts[0])
    blocks = [tuple(hosts[i : i + u]) for i in range(0, ring.size, u)]
    equal = ring.size % u == 0 and all(len(set(b)) == 1 for b in blocks)
    return u if equal and len({b[0] for b in blocks}) == len(blocks) else 1


_LOCAL_RING = Ring(None, 0, 1)
# Process-wide, beside c10d's registry that resolves an op's group name: every ring call
# asks, and a group's rank and size are fixed.
_rings: dict[str, Ring] = {}


def ring_by_name(group_name: str) -> Ring:
    """The ring a custom op was given by name (kept while the name resolves to its group:
    a group destroyed and made anew under the same name is resolved again)."""
    if group_name == LOCAL:
        return _LOCAL_RING
    group = _resolve_process_group(group_name)
    ring = _rings.get(group_name)
    if ring is None or ring.group is not group:
        ring = _rings[group_name] = Ring(group, dist.get_rank(group), dist.get_world_size(group))
    return ring


def served_devices(ring: Ring) -> set[str]:
    """The device types whose tensors the ring's backend can move."""
    config = dist.get_backend_config(ring.group)  # e.g. "cpu:gloo,cuda:nccl" or "gloo"
    served = set()
    for part in config.split(","):
        dev, _, backend = part.rpartition(":")
        served |= {dev} if dev else set(dist.Backend.backend_capability.get(backend, ()))
    return served


def check_backend_serves(ring: Ring, device: torch.device) -> None:
    """Raise if the ring's backend has no implementation for tensors on ``device``.

    Sending a CPU tensor over an NCCL-only group (or a CUDA tensor over a
    gloo-only one) would otherwise fail deep inside the first P2P call, or hang.
    """
    if ring.group is None:
        return
    served = served_devices(ring)
    if device.type not in served:
        raise ValueError(
            f"the ring's process group (backend {dist.get_backend_config(ring.group)!r}) cannot "
            f"move {device.type} tensors; move q, k and v to one of {sorted(served)} or create "
            f"the group with a backend for {device.type} (gloo for cpu, nccl for cuda)"
        )


# The ``SentBytes`` records open in this context (none outside a ``with``): nothing is kept.
_recording: contextvars.ContextVar[tuple] = contextvars.ContextVar("ringify_sent", default=())


class SentBytes:
    """The bytes this process sends to other ranks of a ring while it is open (K/V, their
    gradients, a balanced plan's rows, an all-to-all's share): ``with SentBytes() as sent:
    ...``, then ``sent.bytes``."""

    def __init__(self) -> None:
        self.bytes = 0

    def __enter__(self) -> SentBytes:
        self._token = _recording.set((*_recording.get(), self))
        return self

    def __exit__(self, *exc) -> None:
        _recording.reset(self._token)


def count_sent(nbytes: int) -> None:
    """Add ``nbytes`` sent by this process to every open ``SentBytes``."""
    for record in _recording.get():
        record.bytes += nbytes


class PendingStep:
    """Started sends and receives; ``wait()`` returns the tensors received, one list per
    receive in the order they were asked for."""

    def __init__(self, works: list, received: list[list[torch.Tensor]], sent: list):
        self._works = works
        self._received = received
        self._sent = sent  # send buffers must stay alive until the sends complete

    def wait(self) -> list[list[torch.Tensor]]:
        for work in self._works:
            work.wait()
        self._works, self._sent = [], []
        return self._received


def start_exchange(ring: Ring, sends: list, receives: list, *, tag: int = 0) -> PendingStep:
    """Send each ``(peer, tensors)`` of ``sends``; receive into each ``(peer, buffers)`` of
    ``receives`` from that peer (peers are ranks of the ring).

    ``tag`` keeps concurrent exchanges apart on backends that match by tag (gloo); on
    NCCL, P2P between a pair is matched in issue order, so every rank issues a pair's
    operations in the same order (the ring's steps, and within a step, this order).
    """
    ops, sent, received = [], [], []
    for peer, tensors in sends:
        batch = [t.contiguous() for t in tensors]
        count_sent(sum(t.numel() * t.element_size() for t in batch))
        ops += [
            dist.P2POp(dist.isend, t, group=ring.group, group_peer=peer, tag=tag) for t in batch
        ]
        sent.append(batch)
    for peer, batch in receives:
        ops += [
            dist.P2POp(dist.irecv, t, group=ring.group, group_peer=peer, tag=tag) for t in batch
        ]
        received.append(batch)
    return PendingStep(dist.batch_isend_irecv(ops) if ops else [], received, sent)


def buffers_like(tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> list:
    """Dense receive buffers shaped as ``tensors`` (in ``dtype``, else theirs)."""
    return [torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device) for t in tensors]


class Parcel(enum.IntEnum):
    """What a transfer carries; the value is its tag."""

    KV = 0  # K/V tiles, to the next rank
    DKV = 1  # their gradients, on with the tiles, then home
    QUERY_ROWS = 2  # rows a balanced plan moves, and their results back


class Delivery:
    """A started exchange: ``wait()`` gives every receive by its name (its sends done too,
    so that their buffers may be reused)."""

    def __init__(self, pending, names: list[str]):
        self._pending, self._names = pending, names

    def wait(self) -> dict[str, list[torch.Tensor]]:
        return dict(zip(self._names, self._pending.wait(), strict=True))


class Courier:
    """One exchange of ``parcel`` on ``ring``: ``send`` and ``receive`` what it carries,
    then ``start`` it."""

    def __init__(self, ring: Ring, parcel: Parcel):
        self.ring, self.parcel = ring, parcel
        self._sends: list = []
        self._receives: list = []
        self._names: list[str] = []

    def send(self, peer: int, tensors: list[torch.Tensor]) -> Courier:
        self._sends.append((peer, tensors))
        return self

    def receive(
        self, name: str, peer: int, like: list[torch.Tensor], dtype: torch.dtype | None = None
    ) -> Courier:
        """Receive into new buffers shaped as ``like`` (in ``dtype``, else theirs)."""
        return self.receive_into(name, peer, buffers_like(like, dtype))

    def receive_into(self, name: str, peer: int, buffers: list[torch.Tensor]) -> Courier:
        """Receive into the given dense ``buffers``."""
        self._receives.append((peer, buffers))
        self._names.append(name)
        return self

    def start(self) -> Delivery | None:
        """Start what was sent and received, all at once (None if nothing was)."""
        if not (self._sends or self._receives):
            return None
        pending = start_exchange(self.ring, self._sends, self._receives, tag=int(self.parcel))
        return Delivery(pending, self._names)

    def peer(self, steps: int) -> int:
        """The rank ``steps`` on round the ring from this one (back where negative)."""
        return (self.ring.rank + steps) % self.ring.size
