"""A paper model of one attention's transports on a GPU cluster: what ``strategy="auto"``
picks from, and what ``benchmarks/strategies.py`` tabulates.

Per rank and training step: the attention's kernels at an achieved FLOP rate (the backward
2.5 times the forward); on the ring, each step's K/V (and dK/dV) transfer hidden behind that
step's kernels where shorter, the slowest link setting the pace; an all-to-all not hidden. A
link is the host's (NVLink) between ranks on one host, else the network's. The bytes are
``sent_bytes``, which ``tests/test_ulysses.py`` checks against the report and
``tests/test_all_to_all.py``'s formula against what gloo ranks send. A model, not a
measurement: no GPU has run it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringify.runtime.collectives.heads import Transport, kv_repeats


@dataclass(frozen=True)
class Cluster:
    """What the model assumes of the hardware: an H100 node of 8 by default. ``flops`` is
    what kernels achieve, ``peak_flops`` the dense bf16 peak (for MFU); bandwidths are one
    direction per GPU."""

    flops: float = 400e12  # per second, one GPU's attention kernels (FA2-class, not the peak)
    host_bandwidth: float = 450e9  # bytes per second one GPU sends inside its host (NVLink 4)
    network_bandwidth: float = 50e9  # to another host (one 400 Gb/s NIC per GPU)
    memory: float = 80e9  # bytes of device memory
    peak_flops: float = 989e12
    per_host: int = 8


H100 = Cluster()

# The GPUs ``ringify.estimate`` plans for: datasheet memory, dense bf16 peak, NVLink and one
# NIC per GPU; achieved FLOP/s at 40% of the peak on Hopper and Blackwell, 55% on Ampere.
GPUS = {
    "h100-80gb": H100,
    "h200": Cluster(memory=141e9),
    "b200": Cluster(flops=900e12, host_bandwidth=900e9, memory=180e9, peak_flops=2250e12),
    "a100-80gb": Cluster(flops=170e12, host_bandwidth=300e9, network_bandwidth=25e9,
                         peak_flops=312e12),
    "a100-40gb": Cluster(flops=170e12, host_bandwidth=300e9, network_bandwidth=25e9,
                         memory=40e9, peak_flops=312e12),
    "a800-80gb": Cluster(flops=170e12, host_bandwidth=200e9, network_bandwidth=25e9,
                         peak_flops=312e12),  # an A100 with NVLink at 400 GB/s both ways
}  # fmt: skip


@dataclass(frozen=True)
class Shape:
    """One attention as one rank holds it on the sequence: element counts of q (and of its
    output), of K and V together, and query rows times heads (one lse each); the whole
    sequence's keys; bytes per element and per accumulator element."""

    q: int
    kv: int
    rows: int
    heads: int
    kv_heads: int
    keys: int
    element: int = 2
    accumulator: int = 4
    causal: bool = True
    trained: bool = True


def sent_bytes(shape: Shape, size: int) -> tuple[int, int]:
    """Bytes one rank sends in a step, ``(ring, all-to-all)``, over ``size`` ranks. The ring:
    K/V shards size-1 times each way, dK/dV (in the accumulation dtype) size times, on and
    home. The all-to-all: (size-1)/size of q, K/V (repeated as far as it needs), out and lse
    forward; of dout, q, out, lse, K/V in and dq, dK, dV home backward."""
    e, acc, kv = shape.element, shape.accumulator, shape.kv
    repeats = kv_repeats(shape.heads, shape.kv_heads, size) or 1
    ring = (size - 1) * kv * e
    heads = (2 * shape.q + kv * repeats) * e + shape.rows * acc
    if shape.trained:
        ring += (size - 1) * kv * e + size * kv * acc
        heads += (4 * shape.q + 2 * kv * repeats) * e + shape.rows * acc
    return ring, heads * (size - 1) // size


def transports(heads: int, kv_heads: int, size: int) -> list[Transport]:
    """Every transport these heads allow on ``size`` ranks: the ring, the all-to-all over
    all of them, and the hybrid over each group size u that divides the ring."""
    allowed = [u for u in range(2, size + 1) if size % u == 0 and kv_repeats(heads, kv_heads, u)]
    return [Transport(size, u) for u in (1, *allowed)]


def seconds(shape: Shape, transport: Transport, per_host: int, cluster: Cluster = H100) -> float:
    """Modelled seconds of one rank's attention step on ``transport``, the ring's ranks in
    equal blocks of ``per_host`` consecutive ranks per host."""
    forward = 4 * shape.q * shape.keys * (0.5 if shape.causal else 1.0) / cluster.flops
    backward = 2.5 * forward if shape.trained else 0.0
    size, u = transport.size, transport.heads_group
    exchange = 0.0
    if u > 1:  # the all-to-all over u ranks, some of it to other hosts where u > per_host
        moved = sent_bytes(shape, u)[1]
        across = (u - min(u, per_host)) / (u - 1)
        exchange = max(
            moved * (1 - across) / cluster.host_bandwidth,
            moved * across / cluster.network_bandwidth,
        )
    r = size // u
    if r == 1:
        return forward + backward + exchange
    link = cluster.host_bandwidth if size <= per_host else cluster.network_bandwidth
    kv = shape.kv * (kv_repeats(shape.heads, shape.kv_heads, u) or 1)  # after the all-to-all
    on = kv * shape.element / link
    home = kv * shape.accumulator / link  # dK/dV
    ring = (r - 1) * max(forward / r, on) + forward / r
    if shape.trained:
        ring += (r - 1) * max(backward / r, on + home) + max(backward / r, home)
    return ring + exchange


def fastest(shape: Shape, size: int, per_host: int, cluster: Cluster = H100) -> Transport:
    """The transport the model gives the fewest seconds (the ring where it ties)."""
    options = transports(shape.heads, shape.kv_heads, size)
    return min(options, key=lambda t: seconds(shape, t, per_host, cluster))
