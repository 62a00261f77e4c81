"""Models parallelized inside before ringify sees them: what the trace cannot run.

``torch.export`` cannot trace DTensor parameters (tensor parallelism, or FSDP2 units
inside the model, whose parameters are sharded DTensors outside their forward), and an
FSDP2 unit's hooks would run on the trace's fake tensors. Such a model is refused
before the trace, naming the composition that works: FSDP2 around the ringified model
as one unit. A parameter swapped for a DTensor after a trace makes the state's
description change (``state_kind``), so the cached graph is traced again and refused,
instead of running on the old parameters.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

_WORKS = (
    "What composes today: ringify first, then one FSDP2 unit around the ringified model "
    '(fully_shard(ringify(model, ring_size=P, mesh=mesh["cp"]), mesh=mesh["dp"])), or '
    'DDP over mesh["dp"]; tensor parallelism and per-layer fully_shard are not supported yet.'
)


def state_kind(t: torch.Tensor) -> str:
    """``"DTensor"`` or ``"Tensor"``: part of what a trace assumed about a state tensor."""
    return "DTensor" if isinstance(t, DTensor) else "Tensor"


def check_not_parallelized(model: nn.Module) -> None:
    """Raise if ``model`` holds FSDP2 units or DTensor parameters or buffers."""
    units = [
        name or type(model).__name__
        for name, m in model.named_modules()
        if isinstance(m, FSDPModule)
    ]
    if units:
        raise ValueError(
            f"the model holds FSDP2 units ({', '.join(units[:3])}"
            f"{', ...' if len(units) > 3 else ''}): fully_shard applied inside the model "
            f"runs its hooks on ringify's trace and flattens away per-layer resharding. {_WORKS}"
        )
    dtensors = [
        name
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if isinstance(t, DTensor)
    ]
    if dtensors:
        raise ValueError(
            f"the model's {dtensors[0]} (and {len(dtensors) - 1} more) are DTensors "
            f"(tensor parallelism, e.g. parallelize_module): ringify cannot trace them. {_WORKS}"
        )
