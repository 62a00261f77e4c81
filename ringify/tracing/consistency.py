"""What the ranks of a ring must agree on at each call of a ringified module.

A ring computes one answer from every rank's part, so ranks that were given
different batches, or that are one call apart, produce a wrong answer with no
error. So do ranks whose parameters differ (a model built without a common
seed, a rank that missed an optimizer step). Each call therefore starts with one
small collective (``check_call``): the input signature and modes, the
configuration, and fingerprints of the values of every input the ranks must
share and of the parameters and buffers. A new trace ends with a second one
(``check_trace``) that compares the rewritten graphs (by a canonical digest, blind to
the order of independent nodes) and carries any rank's
trace error, so that every rank raises at once instead of waiting on the ring.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from ringify.config import Config
from ringify.passes.digest import graph_digest
from ringify.runtime.collectives.agreement import check_ranks_agree
from ringify.runtime.collectives.ring import Ring

_FIXES = {
    "input structure": "\nEvery rank of a ring must pass the same arguments (names and nesting).",
    "input shapes": (
        "\nEvery rank of a ring must pass inputs of the same shapes and dtypes (with "
        "inputs='full', the same full batch)."
    ),
    "modes": (
        "\nThe ranks' models differ in train/eval mode or forward hooks: call model.train() "
        "or model.eval(), and register hooks, on every rank alike."
    ),
    "configuration": "\nPass the same ringify(...) arguments on every rank of the ring.",
    "retraced": (
        "\nOne rank traced the model again and the others did not: its parameters changed "
        "dtype, device or shape (model.to(), load_state_dict(assign=True)) on that rank only."
    ),
    "inputs": (
        "\nWith inputs='full' every rank of a ring must be given the same batch (a rank that "
        "skipped a step is on another batch). Usually the "
        "DataLoader's sampler splits the data over all ranks: give DistributedSampler "
        "num_replicas=<number of rings> and rank=<index of this rank's ring> (the data-parallel "
        "size and rank), so that the ranks of one ring share a batch (HF Trainer or "
        "accelerate, which deal batches to the ranks in turn: wrap the sampler in "
        "ringify.RingSampler); or shard the sequence "
        "yourself and pass inputs='sharded'. ringify(..., check_inputs=False) skips this check "
        "once a setup is trusted."
    ),
    "parameters": (
        "\nThe ranks' parameters or buffers differ: every rank of a ring must hold the same "
        "model. Build it from the same seed or load the same checkpoint on every rank, and "
        "make every rank take every optimizer step (a rank that skipped one has drifted)."
    ),
    "graph": "\nThe ranks traced different graphs from the same call: please report this.",
}


def fingerprint(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A float64 number that changes with any input's values, shape or order (on its device)."""
    total = torch.zeros((), dtype=torch.float64, device=tensors[0].device if tensors else "cpu")
    for i, t in enumerate(tensors):
        total = total + (i + 1) * _checksum(t.to(total.device))
    return total


def state_fingerprint(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A float64 number that changes with the values of the model's parameters and buffers:
    one fused norm per device and dtype (floating tensors), a checksum for the others."""
    groups: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append((i, t.detach()))
    device = tensors[0].device if tensors else "cpu"
    total = torch.zeros((), dtype=torch.float64, device=device)
    for (_, dtype), members in groups.items():
        # each member weighted by its place in the group, offset by the group's first index
        # (made on the device: no host-to-device copy)
        first = members[0][0] + 1
        index = torch.arange(first, first + len(members), dtype=torch.float64, device=device)
        if dtype.is_floating_point:
            norms = torch._foreach_norm([t for _, t in members])
        else:
            norms = [_checksum(t) for _, t in members]
        total = total + torch.dot(torch.stack(norms).to(device, torch.float64), index)
    return total


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """Sums of the rows and of the columns of ``t`` viewed as 2-D, each weighted by position.

    Reads ``t`` once, and holds no copy of it: an exchanged pair of rows or of columns
    (batches or positions in another order) changes it.
    """
    t = torch.view_as_real(t.detach()) if t.is_complex() else t.detach()
    grid = t.reshape(-1, t.shape[-1]) if t.dim() else t.reshape(1, 1)
    rows, cols = grid.sum(1, dtype=torch.float64), grid.sum(0, dtype=torch.float64)
    return _weighted(rows) + torch.pi * _weighted(cols) + grid.numel()


def _weighted(x: torch.Tensor) -> torch.Tensor:
    return torch.dot(x, torch.arange(1, x.numel() + 1, dtype=x.dtype, device=x.device))


def check_call(
    ring: Ring,
    *,
    signature: dict[str, object],
    config: Config,
    retraced: bool,
    shared: list[torch.Tensor] | None,
    state: list[torch.Tensor] | None,
    args,
    kwargs,
) -> None:
    """Raise on every rank unless all ranks make the same call, with the same shared inputs
    and model state.

    ``signature`` describes the call (fields that make a new trace), readably.
    ``shared`` and ``state`` are ``None`` when not compared here: not asked for, or not
    known before a new trace (then ``check_trace`` compares them).
    """
    check_ranks_agree(
        ring,
        {
            **signature,
            "configuration": _described(config),
            "retraced": retraced,
            "inputs": 0.0 if shared is None else fingerprint(shared),
            "parameters": 0.0 if state is None else state_fingerprint(state),
        },
        "this call of the ringified model",
        fix=_FIXES,
        details=lambda: _input_checksums(args, kwargs),
    )


def check_trace(
    ring: Ring,
    *,
    graph: torch.fx.GraphModule | None,
    shared: list[torch.Tensor] | None,
    state: list[torch.Tensor] | None,
    error: BaseException | None,
    args,
    kwargs,
) -> None:
    """After a new trace: raise on every rank if any rank's trace failed or the graphs differ
    in what they compute (compared by a canonical digest: the order and names of independent
    nodes may differ between ranks, see ``passes/digest.py``)."""
    check_ranks_agree(
        ring,
        {
            "graph": None if graph is None else _graph_described(graph),
            "inputs": 0.0 if shared is None else fingerprint(shared),
            "parameters": 0.0 if state is None else state_fingerprint(state),
        },
        "the graph traced for this call",
        fix=_FIXES,
        error=error,
        details=lambda: _input_checksums(args, kwargs),
    )


def _graph_described(graph: torch.fx.GraphModule) -> str:
    """The graph's canonical digest and size, readable in a disagreement's message."""
    nodes = sum(len(m.graph.nodes) for m in graph.modules() if isinstance(m, torch.fx.GraphModule))
    return f"digest {graph_digest(graph)[:16]} ({nodes} nodes)"


def _described(config: Config) -> tuple:
    """The configuration as every rank sees it (the group by its size, not its object)."""
    return (
        config.ring_size,
        config.layout,
        config.inputs,
        config.outputs,
        config.dilation,
        config.check_inputs,
    )


def _input_checksums(args, kwargs) -> dict[str, object]:
    """Each tensor input's checksum, by its place in the call (for the error message)."""
    leaves, _ = pytree.tree_flatten_with_path((tuple(args), kwargs))
    return {
        _place(path): round(_checksum(x).item(), 6)
        for path, x in leaves
        if isinstance(x, torch.Tensor)
    }


def _place(path) -> str:
    kind, *rest = path
    name = "args" if kind.idx == 0 else "kwargs"
    return name + "".join(str(key) for key in rest)
