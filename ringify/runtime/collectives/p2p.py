"""P2P exchanges of a ring step: K/V tiles to the next rank, gradients home.

The same code serves NCCL (CUDA tensors) and gloo (CPU tensors): the backend
comes from the process group. A step is started before the block it overlaps
with is computed and waited on after, so the next block is already in flight.
"""

from __future__ import annotations

import contextvars

import torch
import torch.distributed as dist

from ringify.runtime.collectives.ring import Ring

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
