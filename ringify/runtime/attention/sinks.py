"""Attention sinks: a learned logit per head that joins every row's softmax and attends to nothing.

With a sink logit ``z`` (gpt-oss: one per head) a row's probabilities are ``exp(s_j - L)``
with ``L = logsumexp(s, z)``: the keys' share shrinks by ``exp(lse - L)``, where ``lse`` is
the row's log-sum-exp over the keys alone. The ring merges its blocks into ``(out, lse)``
over every key first, so the sink joins once per row, at the end: ``L = logaddexp(lse, z)``
and ``out * exp(lse - L)``. The backward's blocks then recompute the final probabilities
from the final ``out`` and ``L``, and the sink's own gradient is its probability times the
row's ``-rowsum(dO * O)``: ``dz = -sum_rows exp(z - L) * rowsum(dO * O)``.

Shapes: out_BHsD and lse_BHs of this rank's rows; ``sinks`` broadcastable to (B, H, 1, 1).
"""

from __future__ import annotations

import torch


def with_sinks(
    out_BHsD: torch.Tensor, lse_BHs: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' ``(out, lse)`` with the sink in their softmax (a row that saw no key: out 0,
    lse the sink)."""
    sink_BH1 = sinks.to(lse_BHs.dtype).reshape(*sinks.shape[:2], 1)
    lse = torch.logaddexp(lse_BHs, sink_BH1)
    return out_BHsD * torch.exp(lse_BHs - lse).unsqueeze(-1), lse


def sink_grad(
    grad_out_BHsD: torch.Tensor, out_BHsD: torch.Tensor, lse_BHs: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """This rank's rows' part of the sinks' gradient (the ranks' parts sum to it), given the
    op's final ``out`` and ``lse``; shaped and typed like ``sinks``."""
    acc = lse_BHs.dtype
    sink_BH1 = sinks.to(acc).reshape(*sinks.shape[:2], 1)
    delta = (grad_out_BHsD.to(acc) * out_BHsD.to(acc)).sum(-1)
    per_row = -torch.exp(sink_BH1 - lse_BHs) * delta  # (B, H, s)
    summed = per_row.sum(2, keepdim=True) if sinks.shape[0] != 1 else per_row.sum((0, 2))
    return summed.reshape(sinks.shape).to(sinks.dtype)
