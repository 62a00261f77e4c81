"""Agreement across a ring: one small collective that passes on every rank or raises on every rank.

Ranks that disagree (shapes, configuration, inputs, a rank whose own validation
failed) would otherwise hang in the ring until the process-group timeout or abort
inside the backend. ``check_ranks_agree`` exchanges a fixed-size vector of numbers
(one ``all_gather``, one host read) and, only when something is wrong, a second
exchange of readable descriptions so that every rank raises the same error.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from ringify.runtime.collectives.ring import Ring, served_devices

# one side stream per device for the process: an agreement runs at every call, and a new
# stream each time would cost a CUDA stream's creation on the step's critical path (a stream
# holds no state of a call, so sharing it across modules is safe)
_side_streams: dict[torch.device, torch.cuda.Stream] = {}


class RankFailed(RuntimeError):
    """Another rank of the ring raised; raised on the ranks that did not."""


def digest(value: object) -> float:
    """A number that stands for ``value`` (exact in float64): equal on every rank iff ``repr`` is."""
    return float(int.from_bytes(hashlib.sha1(repr(value).encode()).digest()[:6], "little"))


def check_ranks_agree(
    ring: Ring,
    fields: dict[str, object],
    what: str,
    *,
    fix: str | dict[str, str] = "",
    error: BaseException | None = None,
    details: Callable[[], dict[str, object]] | None = None,
    device: torch.device | None = None,
) -> None:
    """Return on every rank if all ranks hold equal ``fields`` and none passed an ``error``.

    Otherwise raise on every rank: the rank that passed ``error`` re-raises it, the
    others raise ``RankFailed`` naming it; on a disagreement every rank raises a
    ``ValueError`` listing each rank's differing fields (and ``details()``, computed
    only then), followed by ``fix`` (or, as a dict, the fix of each differing field). Field values are numbers, 0-d tensors on
    ``device`` (compared bit for bit, so NaN equals NaN), or anything else by digest.
    The number of fields must not depend on anything the ranks could disagree on.
    """
    if ring.size == 1:
        if error is not None:
            raise error
        return
    tensors = [v for v in fields.values() if isinstance(v, torch.Tensor)]
    device = tensors[0].device if tensors else _collective_device(ring, device)
    if device is None:  # the ring cannot move any tensor of this process: nothing to compare
        if error is not None:
            raise error
        return
    # Python numbers only: on CUDA run on a side stream, so that the host read waits
    # for this small collective and not for the work queued on the compute stream.
    stream = _side_stream(device) if not tensors else contextlib.nullcontext()
    with stream:
        # The Python numbers in one host-to-device copy, the device numbers as they are:
        # the error flag first, then every field, in the same order on every rank.
        numbers = [float(error is not None)]
        numbers += [_as_number(v) for v in fields.values() if not isinstance(v, torch.Tensor)]
        local = torch.tensor(numbers, dtype=torch.float64).to(device)
        if tensors:
            as_numbers = [v.detach().to(device, torch.float64).reshape(1) for v in tensors]
            local = torch.cat([local, *as_numbers])
        everyone = local.new_empty(ring.size * local.numel())
        dist.all_gather_single(everyone, local, group=ring.group)
        everyone = everyone.view(ring.size, -1)
        bits = everyone.view(torch.int64)
        if bool((bits == bits[0]).all() & (everyone[:, 0] == 0).all()):  # one host read
            return
    _raise_everywhere(ring, fields, what, fix, error, details)


def _raise_everywhere(ring, fields, what, fix, error, details) -> None:
    """The rare path, taken by every rank together: exchange descriptions, raise one error."""
    mine = {n: _readable(v) for n, v in fields.items()}
    if details is not None and error is None:
        mine |= {n: _readable(v) for n, v in details().items()}
    failure = None if error is None else f"{type(error).__name__}: {error}"
    everyone: list = [None] * ring.size
    dist.all_gather_object(everyone, (mine, failure), group=ring.group)
    failed = [(r, f) for r, (_, f) in enumerate(everyone) if f is not None]
    if error is not None:
        raise error
    if failed:
        listed = "; ".join(f"rank {r}: {f}" for r, f in failed)
        raise RankFailed(
            f"{what}: rank(s) {[r for r, _ in failed]} of the ring raised ({listed}); "
            f"this rank stops too instead of waiting for the ring"
        )
    lines, fixes = [], []
    for name in dict.fromkeys(n for fields_of, _ in everyone for n in fields_of):
        values = [fields_of.get(name) for fields_of, _ in everyone]
        if any(v != values[0] for v in values):
            lines.append(f"{name}: " + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)))
            fixes.append(fix.get(name, "") if isinstance(fix, dict) else "")
    fixes = "".join(fixes) if isinstance(fix, dict) else fix
    raise ValueError(f"the ranks of the ring disagree on {what}:\n  " + "\n  ".join(lines) + fixes)


def _as_number(value: object) -> float:
    return float(value) if isinstance(value, bool | int | float) else digest(value)


def _readable(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.item()
    return value


def _collective_device(ring: Ring, preferred: torch.device | None) -> torch.device | None:
    """A device the ring's backend moves tensors of: ``preferred`` if it can, else CPU, else
    the current CUDA device; ``None`` if none is available."""
    served = served_devices(ring)
    if preferred is not None and preferred.type in served:
        return preferred
    if "cpu" in served:
        return torch.device("cpu")
    if "cuda" in served and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _side_stream(device: torch.device):
    if device.type != "cuda":
        return contextlib.nullcontext()
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return torch.cuda.stream(_side_streams[device])
