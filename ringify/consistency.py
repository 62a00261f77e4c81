"""What the ranks of a ring must agree on at each call of a ringified module.

A ring computes one answer from every rank's part, so ranks that were given
different batches, or that are one call apart, produce a wrong answer with no
error. Each call therefore starts with one small collective (``check_call``):
the call count, the input signature, the configuration, and a fingerprint of the
values of every input the ranks must share. A new trace ends with a second one
(``check_trace``) that compares the rewritten graphs and carries any rank's
trace error, so that every rank raises at once instead of waiting on the ring.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from ringify.config import Config
from ringify.runtime.agreement import check_ranks_agree
from ringify.runtime.ring import Ring

_FIXES = {
    "calls": (
        "\nA rank skipped or repeated a call (for example it caught an error and went on): "
        "every rank of a ring must call the model the same number of times, in step."
    ),
    "signature": (
        "\nThe ranks passed inputs of different structure, shapes or dtypes, or their models "
        "differ in train/eval mode or hooks: every rank of a ring must make the same call."
    ),
    "configuration": "\nPass the same ringify(...) arguments on every rank of the ring.",
    "retraced": (
        "\nOne rank traced the model again and the others did not: its parameters changed "
        "dtype, device or shape (model.to(), load_state_dict(assign=True)) on that rank only."
    ),
    "inputs": (
        "\nWith inputs='full' every rank of a ring must be given the same batch. Usually the "
        "DataLoader's sampler splits the data over all ranks: give DistributedSampler "
        "num_replicas=<number of rings> and rank=<index of this rank's ring> (the data-parallel "
        "size and rank), so that the ranks of one ring share a batch; or shard the sequence "
        "yourself and pass inputs='sharded'. ringify(..., check_inputs=False) skips this check "
        "once a setup is trusted."
    ),
    "graph": "\nThe ranks traced different graphs from the same call: please report this.",
}


def fingerprint(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A float64 number that changes with any input's values, shape or order (on its device)."""
    total = torch.zeros((), dtype=torch.float64, device=tensors[0].device if tensors else "cpu")
    for i, t in enumerate(tensors):
        total = total + (i + 1) * _checksum(t.to(total.device))
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
    calls: int,
    signature: tuple,
    config: Config,
    retraced: bool,
    shared: list[torch.Tensor] | None,
    args,
    kwargs,
) -> None:
    """Raise on every rank unless all ranks make the same call, with the same shared inputs.

    ``shared`` is ``None`` when not known yet (the first call of a signature in
    ``inputs="sharded"`` mode): ``check_trace`` compares them after the trace.
    """
    check_ranks_agree(
        ring,
        {
            "calls": calls,
            "signature": signature,
            "configuration": _described(config),
            "retraced": retraced,
            "inputs": 0.0 if shared is None else fingerprint(shared),
        },
        "this call of the ringified model",
        fix=_FIXES,
        details=lambda: _input_checksums(args, kwargs),
    )


def check_trace(
    ring: Ring,
    *,
    graph_code: str | None,
    shared: list[torch.Tensor] | None,
    error: BaseException | None,
    args,
    kwargs,
) -> None:
    """After a new trace: raise on every rank if any rank's trace failed or the graphs differ."""
    check_ranks_agree(
        ring,
        {"graph": graph_code, "inputs": 0.0 if shared is None else fingerprint(shared)},
        "the graph traced for this call",
        fix=_FIXES,
        error=error,
        details=lambda: _input_checksums(args, kwargs),
    )


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
