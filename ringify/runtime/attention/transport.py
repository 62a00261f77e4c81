"""How a call's K/V reach its queries: the seam between the ring op's loop and the network.

The loop (``ops.py``) attends each query tile to the K/V tiles it holds at each visit and
merges the blocks; what it holds, and where its rows come from and go back to, is the
transport's, chosen by the plan (``masks/plan.py``):

- ``P2PRing``: K/V tiles travel round the ring, one step per visit, their dK/dV with them and
  home (``tiling/grad_trip.py``); a balanced plan's query rows move in first and their results
  move home after (``tiling/moves.py``);
- ``AllToAll`` (DeepSpeed-Ulysses): one all-to-all gives each rank every row of its share of
  the heads (``collectives/heads.py``); the loop then runs on a one-rank ring over the whole
  sequence, and the results, dq, dk and dv go back with a second all-to-all. GQA's K/V heads
  are repeated only as far as the ring needs (``kv_repeats``), their gradients summed back.
  The hybrid (USP) is the same class with the all-to-all inside groups of u consecutive
  ranks and the loop on the ring of the P / u groups (the ranks with this one's place in
  theirs), whose K/V travel as P2PRing's do.

Both expose the same five steps, so the loop is written once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ringify.runtime.collectives.heads import kv_repeats, to_heads, to_sequence
from ringify.runtime.collectives.ring import (
    LOCAL,
    Ring,
    ring_by_name,
    strided_ring_name,
    sub_ring_name,
)
from ringify.runtime.masks.plan import RingPlan, heads_group
from ringify.runtime.tiling.grad_trip import GradTrip
from ringify.runtime.tiling.moves import ShardRows, move_home, rows_in
from ringify.runtime.tiling.schedule import ring_visits


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

    def visits(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[tuple]:
        """``(own, step, src, held, kv)`` per visit (``schedule.ring_visits``)."""
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
    u = heads_group(plan.transport, ring.size)
    if u == 1:
        return P2PRing(ring, plan)
    group = ring_by_name(sub_ring_name(ring, u))
    across = ring_by_name(strided_ring_name(ring, u) if u < ring.size else LOCAL)
    return AllToAll(group, across, plan, q.shape[1], k.shape[1])
