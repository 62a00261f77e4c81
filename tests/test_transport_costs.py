"""The paper model ``strategy="auto"`` picks from (``runtime/collectives/transport_costs.py``): its bytes,
its ring hidden behind the kernels, the picks ``benchmarks/strategies.py`` tabulates for
Llama-3 layers on nodes of 8 GPUs, and "auto" itself: that pick on GPUs, the ring on CPU
ranks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks.strategies import shape
from ringify.passes.sharding.strategy import auto_transport
from ringify.runtime.collectives.heads import Transport
from ringify.runtime.collectives.transport_costs import (
    Shape,
    fastest,
    seconds,
    sent_bytes,
    transports,
)


def test_sent_bytes():
    """4 query heads on 2 K/V heads, 8 rows of head dim 4 per rank, bf16, float32 lse and
    accumulators, on 4 ranks (K/V repeated twice for the all-to-all)."""
    s = Shape(q=4 * 8 * 4, kv=2 * 2 * 8 * 4, rows=4 * 8, heads=4, kv_heads=2, keys=32)
    ring = 3 * 128 * 2 + 3 * 128 * 2 + 4 * 128 * 4
    heads = (2 * 128 + 256) * 2 + 32 * 4 + (4 * 128 + 512) * 2 + 32 * 4
    assert sent_bytes(s, 4) == (ring, heads * 3 // 4)
    inference = Shape(q=128, kv=128, rows=32, heads=4, kv_heads=2, keys=32, trained=False)
    assert sent_bytes(inference, 4) == (3 * 128 * 2, ((2 * 128 + 256) * 2 + 32 * 4) * 3 // 4)


def test_transports_the_heads_allow():
    assert transports(32, 8, 64) == [Transport(64, u) for u in (1, 2, 4, 8, 16, 32)]
    assert transports(6, 6, 4) == [Transport(4, 1), Transport(4, 2)]


def test_a_ring_hidden_behind_its_kernels_costs_its_kernels():
    s = shape(32, 8, 1 << 20, 8)
    assert seconds(s, Transport(8), 8) == pytest.approx(seconds(s, Transport(1), 1))
    # across hosts at 32K the network does not hide: the ring costs more than its kernels
    short = shape(32, 8, 1 << 15, 64)
    assert seconds(short, Transport(64), 8) > 2 * seconds(short, Transport(1), 1)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "seq", "gpus", "want"),
    [
        (32, 8, 1 << 15, 8, 1),  # inside a node, hidden
        (32, 8, 1 << 15, 16, 4),
        (32, 8, 1 << 15, 64, 8),  # Ulysses over 64 cannot split 32 heads
        (32, 8, 1 << 20, 64, 1),  # a million tokens hide the network
        (64, 8, 1 << 15, 64, 8),
    ],
)
def test_the_picks_of_the_table(heads, kv_heads, seq, gpus, want):
    """``want``: the ranks the picked all-to-all spans (1: the ring)."""
    assert fastest(shape(heads, kv_heads, seq, gpus), gpus, 8) == Transport(gpus, want)


def test_auto_is_the_models_pick_on_gpus_and_the_ring_on_cpu_ranks():
    auto = SimpleNamespace(ring=SimpleNamespace(size=64), per_host=lambda device: 8)
    s = shape(32, 8, 1 << 15, 64)
    assert auto_transport(s, torch.device("cuda"), auto) == (Transport(64, 8), "")
    picked, note = auto_transport(s, torch.device("cpu"), auto)
    assert picked == Transport(64) and "CPU ranks" in note
    long = shape(32, 8, 1 << 20, 64)
    assert auto_transport(long, torch.device("cuda"), auto) == (
        Transport(64), "auto: the ring is modelled fastest")  # fmt: skip


def test_a_program_that_reads_positions_is_counted_causal():
    """A causal, window or document program skips about half the blocks or more; a padding
    program few: the model counts the first at half the FLOPs, the second dense."""
    from ringify.passes.sharding.strategy import _reads_positions
    from ringify.runtime.masks.program import MaskProgram

    causal = MaskProgram((), (("le.Tensor", ({"pos": "k"}, {"pos": "q"}), "bool"),))
    padding = MaskProgram(("k",), (("eq.Scalar", ({"in": 0}, 1), "bool"),))
    assert _reads_positions(SimpleNamespace(args=[causal.text()]))
    assert not _reads_positions(SimpleNamespace(args=[padding.text()]))


def hosts_under_a_fake_mode() -> int:
    """On every rank: ``ranks_per_host`` asked while a fake mode is active, as a trace may."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ringify.runtime.collectives.ring import ranks_per_host, resolve_ring

    with FakeTensorMode():
        return ranks_per_host(resolve_ring(dist.group.WORLD), torch.device("cpu"))


def test_the_ranks_of_one_host(ranks):
    """Every rank of the pool runs on this host: blocks of the whole ring."""
    assert ranks(2).run(hosts_under_a_fake_mode) == [2, 2]
