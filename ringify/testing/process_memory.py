"""Memory of a CPU process (Linux) and of what autograd saves, for tests, benchmarks and
examples."""

from __future__ import annotations


def resident_bytes(field: str = "VmRSS:") -> int:
    """This process's resident set (``VmHWM:``: its peak since ``reset_peak_memory``), Linux."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_memory() -> None:
    """Reset the kernel's record of this process's peak resident set (``VmHWM``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measured_step(step, barrier: bool = True) -> tuple[float, int, object]:
    """``(seconds, peak resident bytes above the start, result)`` of ``step()``, after a
    garbage collection and, with ``barrier``, a barrier of the default process group (so
    that the ranks of a ring start together)."""
    import gc
    import time

    import torch.distributed as dist

    gc.collect()
    base = resident_bytes("VmRSS:")
    reset_peak_memory()
    if barrier:
        dist.barrier()
    t0 = time.perf_counter()
    result = step()
    seconds = time.perf_counter() - t0
    return seconds, resident_bytes("VmHWM:") - base, result


def saved_for_backward_bytes(step, leave_out=()) -> tuple[int, object]:
    """``(bytes, result)``: the storage autograd saves for the backward while ``step()``
    runs (each storage once), leaving out the storages of ``leave_out`` (the parameters;
    a callable returning them is asked at each save, for FSDP, whose all-gathered
    parameters exist only during their block). A checkpointed region's inner tensors are
    saved by the checkpoint, not here: only what the checkpoint keeps (its inputs) is
    counted, as torch's own hooks see it."""
    import torch
    from torch._subclasses.fake_tensor import is_fake

    def storages(tensors) -> set[int]:
        local = (t.to_local() if hasattr(t, "to_local") else t for t in tensors)
        return {t.untyped_storage().data_ptr() for t in local}

    fixed = None if callable(leave_out) else storages(leave_out)
    seen: dict[int, int] = {}

    def pack(t):
        if is_fake(t):  # a trace inside the step
            return t
        storage = t.untyped_storage()
        skip = fixed if fixed is not None else storages(leave_out())
        if storage.data_ptr() not in skip and storage.device.type != "meta":
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = step()
    return sum(seen.values()), result
