"""The backward's dK/dV exchange overlaps its compute: each step computes its blocks before it
waits for the dK/dV that travel from the step before (they are added after, not awaited first)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from ringify.testing.ring_vs_sdpa import make_inputs, ring_forward_backward


def backward_events(world_inputs):
    """The order of the backward's block kernels, dK/dV exchanges started and waited for."""
    from ringify.runtime.attention import ops as ring_ops
    from ringify.runtime.collectives import ring as ring_module

    events = []
    start, block = ring_module.start_exchange, ring_ops.block_backward

    def started(*args, tag, **kwargs):
        pending = start(*args, tag=tag, **kwargs)
        if tag != ring_module.Parcel.DKV:  # K/V tiles travelling
            return pending
        wait = pending.wait

        def waited():
            events.append("wait")
            return wait()

        pending.wait = waited
        events.append("start")
        return pending

    def computed(*args, **kwargs):
        events.append("block")
        return block(*args, **kwargs)

    with (
        mock.patch.object(ring_module, "start_exchange", started),
        mock.patch.object(ring_ops, "block_backward", computed),
    ):
        ring_forward_backward(*world_inputs, "zigzag", {"is_causal": False})
    return events


@pytest.mark.parametrize("world", [2, 4])
def test_each_step_computes_before_it_waits_for_the_travelling_gradients(ranks, world):
    inputs = make_inputs(1, 2, 2, 8 * world, 8, torch.float64)
    for events in ranks(world).run(backward_events, inputs):
        waits = [i for i, event in enumerate(events) if event == "wait"]
        assert len(waits) == world and events.count("block") >= world, events
        # every step's blocks run between starting the exchange and waiting for it; only
        # the trip's last exchange (the gradients going home) has nothing left to overlap
        assert all(events[i - 1] == "block" for i in waits[:-1]), events


def kernel_calls(world_inputs, tiles_per_chunk):
    """How many block kernel calls this rank's forward made."""
    from ringify.runtime.attention import ops as ring_ops

    calls, block = [], ring_ops.block_forward

    def counted(*args, **kwargs):
        calls.append(args[0].shape[2])
        return block(*args, **kwargs)

    with mock.patch.object(ring_ops, "block_forward", counted):
        ring_forward_backward(*world_inputs, "zigzag", {"is_causal": True}, tiles_per_chunk)
    return len(calls)


@pytest.mark.parametrize("world", [2, 4])
def test_a_causal_ring_makes_one_call_per_step_as_pytorch_does(ranks, world):
    """With one tile per chunk, a causal zigzag ring joins each step's pairs: the shard's own
    causal triangle is one call, and the fully visible pairs of a later step one more (their
    query tiles are adjacent rows, their key tiles arrived side by side): at most one
    forward call per step, where the first step alone made three. Exactness with
    the joins is the ring attention tests' (every layout and tiling)."""
    inputs = make_inputs(1, 2, 2, 8 * world, 8, torch.float64)
    counts = ranks(world).run(kernel_calls, inputs, 1)
    assert all(calls <= world for calls in counts), counts  # the forward's: one per step
