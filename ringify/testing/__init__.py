"""Helpers shared by tests, benchmarks and examples (not public API).

- ``RankPool``: reusable gloo (or NCCL) rank processes with timeouts, and ``outcome``,
  what a rank's call did (``ranks.py``);
- ``resident_bytes`` / ``reset_peak_memory``: a CPU process's (peak) memory, and
  ``measured_step``: the time and peak memory of one step; ``saved_for_backward_bytes``:
  what autograd keeps for the backward (``process_memory.py``);
- ``ringify.testing.ring_vs_sdpa``: ring attention against SDPA on the full sequence;
- ``ringify.testing.models``: small models written as users write them;
- ``ringify.testing.runs``: a model ringified over the current group, eager or compiled;
- ``ringify.testing.rounds``: benchmark configurations run round-robin, the best of each.
"""

from ringify.testing.process_memory import (
    measured_step,
    reset_peak_memory,
    resident_bytes,
    saved_for_backward_bytes,
)
from ringify.testing.ranks import RankPool, outcome

__all__ = [
    "RankPool",
    "measured_step",
    "outcome",
    "reset_peak_memory",
    "resident_bytes",
    "saved_for_backward_bytes",
]
