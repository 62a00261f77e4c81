"""P2P rotation: one ring step, every rank sends to the next and receives from the previous.

The same code serves NCCL (CUDA tensors) and gloo (CPU tensors): the backend
comes from the process group. A step is started before the block it overlaps
with is computed and waited on after, so the next block is already in flight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringify.runtime.ring import Ring

_sent_bytes = 0  # every byte this process has sent round a ring (benchmarks read it)


def sent_bytes() -> int:
    """Bytes this process has sent round rings so far (K/V and their gradients)."""
    return _sent_bytes


class PendingStep:
    """A started rotation; ``wait()`` returns the tensors received from the previous rank."""

    def __init__(
        self, works: list[dist.Work], received: list[torch.Tensor], sent: list[torch.Tensor]
    ):
        self._works = works
        self._received = received
        self._sent = sent  # send buffers must stay alive until the sends complete

    def wait(self) -> list[torch.Tensor]:
        for work in self._works:
            work.wait()
        self._works, self._sent = [], []
        return self._received


def start_rotation(ring: Ring, tensors: list[torch.Tensor], *, tag: int = 0) -> PendingStep:
    """Send ``tensors`` to rank+1 and receive tensors of the same shapes from rank-1.

    ``tag`` keeps concurrent rotations apart on backends that match by tag (gloo);
    on NCCL, P2P between a pair is matched in issue order, which every rank shares.
    """
    global _sent_bytes
    assert ring.group is not None and ring.size > 1
    sent = [t.contiguous() for t in tensors]
    _sent_bytes += sum(t.numel() * t.element_size() for t in sent)
    received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in sent]
    nxt, prev = (ring.rank + 1) % ring.size, (ring.rank - 1) % ring.size
    ops = [dist.P2POp(dist.isend, t, group=ring.group, group_peer=nxt, tag=tag) for t in sent]
    ops += [dist.P2POp(dist.irecv, t, group=ring.group, group_peer=prev, tag=tag) for t in received]
    return PendingStep(dist.batch_isend_irecv(ops), received, sent)
