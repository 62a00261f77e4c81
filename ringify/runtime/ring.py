"""The ring: one step of P2P rotation, every rank sends to the next and receives from the previous.

The same code serves NCCL (CUDA tensors) and gloo (CPU tensors): the backend
comes from the process group. A step is started before the block it overlaps
with is computed and waited on after, so the next block is already in flight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringify.runtime.groups import Ring


class PendingStep:
    """A started rotation; ``wait()`` returns the tensor received from the previous rank."""

    def __init__(self, works: list[dist.Work], received: torch.Tensor, sent: torch.Tensor):
        self._works = works
        self._received = received
        # The send buffer must stay alive until the send completes.
        self._sent = sent

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._works, self._sent = [], None
        return self._received


def start_rotation(ring: Ring, tensor: torch.Tensor, *, tag: int = 0) -> PendingStep:
    """Send ``tensor`` to rank+1 and receive a tensor of the same shape from rank-1.

    ``tag`` keeps concurrent rotations apart on backends that match by tag (gloo);
    on NCCL, P2P between a pair is matched in issue order, which every rank shares.
    """
    assert ring.group is not None and ring.size > 1
    received = torch.empty_like(tensor)
    ops = [
        dist.P2POp(
            dist.isend, tensor, group=ring.group, group_peer=(ring.rank + 1) % ring.size, tag=tag
        ),
        dist.P2POp(
            dist.irecv, received, group=ring.group, group_peer=(ring.rank - 1) % ring.size, tag=tag
        ),
    ]
    return PendingStep(dist.batch_isend_irecv(ops), received, tensor)


def pack(*tensors: torch.Tensor) -> torch.Tensor:
    """One flat buffer holding ``tensors`` (one message per ring step instead of several)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unpack(buffer: torch.Tensor, *like: torch.Tensor) -> list[torch.Tensor]:
    """Views into ``buffer`` shaped like ``like`` (the inverse of ``pack``)."""
    views, offset = [], 0
    for t in like:
        views.append(buffer[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return views
