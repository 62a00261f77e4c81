"""Peak memory of a CPU process (Linux), for benchmarks and examples."""

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
