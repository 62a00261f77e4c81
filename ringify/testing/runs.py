"""Running a model ringified in a test, over the current process group, eager or compiled; and
reading its rewritten graph: what it would allocate.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import fx, nn

from ringify import ringify


def ringified_run(model: nn.Module, backend: str | None = None, **config):
    """``(ringified, run)``: ``model`` ringified over the whole default group, and what to
    call it through: itself, or ``torch.compile`` of it with ``backend`` (fullgraph)."""
    ringified = ringify(model, ring_size=dist.get_world_size(), **config)
    if not backend:
        return ringified, ringified
    torch._dynamo.reset()
    return ringified, torch.compile(ringified, backend=backend, fullgraph=True)


def inductor_control(model: nn.Module, backend: str | None):
    """The unmodified ``model`` compiled with Inductor when ``backend`` is Inductor, else None:
    a compiled test's control. Inductor fuses and reorders what a model computes below
    float64 (HF's float32 loss, a float32 router); its own difference from eager, measured
    beside the ringified model's, sets that model's bound (``tolerance.inductor_bound``)."""
    if backend != "inductor":
        return None
    torch._dynamo.reset()
    return torch.compile(model, backend="inductor")


def quadratic_nodes(ringified, length: int) -> list[str]:
    """Nodes of the last call's rewritten graph (and of the regions it outlined) whose value
    on a rank (``meta["val"]``) is S x S or a rank's rows of it: two dims of the sequence's
    global (or padded) ``length``, or last two dims of a rank's rows by the whole length."""
    traced = ringified._last()
    whole = {length, traced.report.padded}
    rows = whole | {traced.report.padded // traced.report.ring_size}
    found = []
    graphs = [m.graph for m in traced.module.modules() if isinstance(m, fx.GraphModule)]
    for node in (n for graph in graphs for n in graph.nodes):
        vals = node.meta.get("val")
        for v in vals if isinstance(vals, (list, tuple)) else [vals]:
            if not isinstance(v, torch.Tensor):
                continue
            dims = list(v.shape)
            if sum(d in whole for d in dims) >= 2 or (
                dims[-2:-1] and dims[-2] in rows and dims[-1] in whole
            ):
                found.append(node.name)
    return found
