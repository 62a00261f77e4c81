"""Running a model ringified in a test: over the current process group, eager or compiled."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ringify import ringify


def ringified_run(model: nn.Module, backend: str | None = None, **config):
    """``(ringified, run)``: ``model`` ringified over the whole default group, and what to
    call it through: itself, or ``torch.compile`` of it with ``backend`` (fullgraph)."""
    ringified = ringify(model, ring_size=dist.get_world_size(), **config)
    if not backend:
        return ringified, ringified
    torch._dynamo.reset()
    return ringified, torch.compile(ringified, backend=backend, fullgraph=True)
