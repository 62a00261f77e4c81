"""The ring a call runs on: process-group resolution shared by every runtime op.

Custom ops cannot take a ``ProcessGroup`` argument, so a group travels as its
name (``""`` means "no ring": torch.distributed is not initialised or the group
has one rank), as ``torch.distributed._functional_collectives`` does.
"""

from __future__ import annotations

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
_rings: dict[str, Ring] = {}  # by group name: every ring call asks, and rank and size are fixed


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
