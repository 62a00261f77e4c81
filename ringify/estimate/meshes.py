"""Each mesh's memory per GPU and modelled step, from a ``Footprint`` and a ``Cluster``.

A mesh is ``dp x tp x cp`` GPUs, TP innermost (inside a host), then the ring, then data
parallelism; FSDP2 shards the state over ``dp x cp`` (torchtitan's "loss" mesh), the ring
or the all-to-all shards the sequence over ``cp``. Memory is counted, time is a paper model
(``runtime/collectives/transport_costs.py``): no GPU has run it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringify.estimate.footprint import Footprint
from ringify.runtime.collectives.heads import Transport, kv_repeats
from ringify.runtime.collectives.transport_costs import Cluster, Shape, fastest, seconds, transports

GIB = 2**30
# Bytes per parameter of the state FSDP2 shards: float32 master weights, float32 gradients
# and AdamW's two float32 moments (torchtitan's mixed precision); the weights compute in the
# footprint's dtype, gathered a block at a time (two with prefetch).
MASTER, GRADIENT, ADAMW = 4, 4, 8


@dataclass(frozen=True)
class Mesh:
    dp: int
    tp: int
    cp: int
    transport: Transport  # the attention's over the cp ranks

    @property
    def strategy(self) -> str:
        u = self.transport.heads_group
        if self.cp == 1:
            return "-"
        return "ring" if u == 1 else "ulysses" if u == self.cp else f"Hybrid({u})"


@dataclass(frozen=True)
class Row:
    """One mesh's figures per GPU: bytes, and a modelled step in seconds."""

    mesh: Mesh
    checkpointing: bool
    weights: float
    gradients: float
    optimizer: float
    activations: float  # the step's peak beyond the state, as run
    activations_other: float  # the same with checkpointing the other way
    buffers: float  # the attention's transport buffers
    forward: float  # the forward's peak, and the outputs gathered beside it (outputs="full")
    outputs: float
    compute: float  # seconds: matmuls and attention kernels (recompute included)
    exposed: float  # seconds of communication not hidden behind compute
    tokens_per_gpu: float  # per second
    mfu: float
    auto: bool  # strategy="auto" picks this transport on this mesh

    @property
    def total(self) -> float:
        state = self.weights + self.gradients + self.optimizer
        return state + max(self.activations + self.buffers, self.forward + self.outputs)

    @property
    def step(self) -> float:
        return self.compute + self.exposed


def meshes(gpus: int, cluster: Cluster, heads: int, kv_heads: int, seq: int) -> list[Mesh]:
    """Every ``dp x tp x cp = gpus``: TP within a host and dividing the K/V heads, each
    transport the ring's heads allow."""
    out = []
    for tp in range(1, min(gpus, cluster.per_host) + 1):
        if gpus % tp or kv_heads % tp:
            continue
        for cp in range(1, gpus // tp + 1):
            if (gpus // tp) % cp or seq % cp:
                continue
            options = transports(heads // tp, kv_heads // tp, cp) if cp > 1 else [Transport(1)]
            out += [Mesh(gpus // tp // cp, tp, cp, t) for t in options]
    return out


def _shapes(fp: Footprint, positions: int, seq: int, trained: bool = True) -> list[Shape]:
    return [
        Shape(
            q=positions * a.heads * a.head_dim,
            kv=positions * a.kv_heads * (a.head_dim + a.v_head_dim),
            rows=positions * a.heads,
            heads=a.heads,
            kv_heads=a.kv_heads,
            keys=seq,
            element=fp.element,
            causal=a.causal,
            trained=trained,
        )
        for a in fp.attentions
    ]


def _buffers(shape: Shape, transport: Transport) -> float:
    """Bytes one attention's transport holds beyond what is kept: the ring's next K/V and
    its dK/dV accumulators; the all-to-all's q, K/V and out in flight."""
    u, e = transport.heads_group, shape.element
    ring = 0.0 if transport.size // u == 1 else shape.kv * (2 * e + 2 * shape.accumulator)
    heads = 0.0
    if u > 1:
        repeats = kv_repeats(shape.heads, shape.kv_heads, u) or 1
        heads = (2 * shape.q + shape.kv * repeats) * e
        ring *= repeats
    return ring + heads


def row(
    fp: Footprint,
    mesh: Mesh,
    seq: int,
    batch: int,
    cluster: Cluster,
    checkpointing: bool,
    fsdp: bool = True,
    optimizer: bool = True,
    outputs: str = "sharded",
) -> Row:
    """The figures of one mesh (batch sequences of ``seq`` per data-parallel replica);
    without ``fsdp`` the state whole on every rank, without ``optimizer`` no AdamW; with
    ``outputs="full"`` every rank holds the other ranks' parts of the outputs too."""
    positions = batch * seq // mesh.cp
    local = fp.tp_split / mesh.tp + (fp.parameters - fp.tp_split)  # one TP rank's elements
    shards = mesh.dp * mesh.cp if fsdp else 1
    unsharded = 2 * fp.largest_block / mesh.tp * fp.element if fsdp else 0.0
    # outputs="full": at the forward's end the whole outputs, and as long again while the
    # ranks' parts are put in order (measured on gloo ranks: 2 cp - 1 times the rank's part)
    gathered = 0.0
    if outputs == "full":
        gathered = fp.outputs.per_position * positions * (2 * mesh.cp - 1)
    kept, other = fp.activations, fp.checkpointed
    forward = fp.forward_checkpointed if checkpointing else fp.forward
    if checkpointing:
        kept, other = other, kept

    shapes = _shapes(fp, positions, seq)
    per_host = min(cluster.per_host, mesh.cp * mesh.tp) // mesh.tp or 1
    attention = sum(seconds(s, mesh.transport, per_host, cluster) for s in shapes)
    kernels = sum(seconds(s, Transport(1), 1, cluster) for s in shapes)
    matmuls = 3 * fp.flops.at(positions) / cluster.flops
    recompute = 0.0
    if checkpointing:  # the forward again: its matmuls and its attention (on its transport)
        recompute = fp.flops.at(positions) / cluster.flops + sum(
            seconds(s, mesh.transport, per_host, cluster)
            for s in _shapes(fp, positions, seq, trained=False)
        )
    compute = matmuls + kernels + recompute
    # TP: two all-reduces of the blocks' (positions x hidden) forward, two backward, each
    # sending 2 (tp - 1) / tp of it, over NVLink, not overlapped (two more to recompute)
    reduces = (4 + 2 * checkpointing) * fp.blocks
    tp_time = 0.0
    if mesh.tp > 1:
        moved = reduces * 2 * (mesh.tp - 1) / mesh.tp * positions * fp.hidden * fp.element
        tp_time = moved / cluster.host_bandwidth
    # FSDP2: all-gather forward and backward in the compute dtype, reduce-scatter float32,
    # overlapped with compute
    fsdp_time = 0.0
    if fsdp and shards > 1:
        moved = local * (2 * fp.element + GRADIENT) * (shards - 1) / shards
        inside = mesh.dp * mesh.cp * mesh.tp <= cluster.per_host
        fsdp_time = moved / (cluster.host_bandwidth if inside else cluster.network_bandwidth)
    exposed = (attention - kernels) + tp_time + max(0.0, fsdp_time - compute)
    step = compute + exposed
    useful = 3 * fp.flops.at(positions) + kernels * cluster.flops  # recompute left out
    auto = mesh.cp > 1 and bool(shapes)
    auto = auto and fastest(shapes[0], mesh.cp, per_host, cluster) == mesh.transport
    return Row(
        mesh=mesh,
        checkpointing=checkpointing,
        weights=local / shards * MASTER + unsharded,
        gradients=local / shards * GRADIENT,
        optimizer=local / shards * ADAMW * optimizer,
        activations=kept.at(positions),
        activations_other=other.at(positions),
        buffers=max((_buffers(s, mesh.transport) for s in shapes), default=0.0),
        forward=forward.at(positions),
        outputs=gathered,
        compute=compute,
        exposed=exposed,
        tokens_per_gpu=batch * seq / (step * mesh.tp * mesh.cp),
        mfu=useful / (step * cluster.peak_flops),
        auto=auto,
    )
