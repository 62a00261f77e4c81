"""Bad input to ring_attention / shard / gather: a ValueError naming the fix, before any communication."""

from __future__ import annotations

import pytest
import torch

from ringify.runtime import gather, ring_attention, shard
from ringify.testing import outcome
from ringify.testing.ranks import PG_TIMEOUT_S


def qkv(heads=4, kv_heads=4, seq=16, dim=8, dtype=torch.float32):
    return (
        torch.randn(1, heads, seq, dim, dtype=dtype),
        torch.randn(1, kv_heads, seq, dim, dtype=dtype),
        torch.randn(1, kv_heads, seq, dim, dtype=dtype),
    )


@pytest.mark.parametrize(
    ("make", "kwargs", "match"),
    [
        (lambda: qkv(), {"dropout_p": 0.1}, "dropout"),
        (lambda: qkv(), {"attn_mask": torch.ones(8, 16, dtype=torch.bool)}, "does not broadcast"),
        (lambda: qkv(), {"attn_mask": torch.ones(16, 16, dtype=torch.int64)}, "bool"),
        (
            lambda: qkv(),
            {"attn_mask": torch.ones(16, 16, dtype=torch.bool), "is_causal": True},
            "not both",
        ),
        (lambda: qkv(heads=4, kv_heads=2), {}, "enable_gqa=True"),
        (lambda: qkv(heads=6, kv_heads=4), {"enable_gqa": True}, "multiple"),
        (lambda: (qkv()[0], *qkv(seq=8)[1:]), {}, "same local sequence length"),
        (lambda: (qkv()[0], qkv(dim=4)[1], qkv()[2]), {}, "head_dim"),
        (lambda: (qkv()[0][0], *qkv()[1:]), {}, "4-D"),
        (lambda: (qkv()[0].double(), *qkv()[1:]), {}, "one dtype"),
        (lambda: qkv(seq=15), {"is_causal": True, "layout": "zigzag"}, "zigzag"),
        (lambda: qkv(), {"layout": "striped"}, "layout must be one of"),
    ],
    ids=[
        "dropout",
        "mask-shape",
        "mask-dtype",
        "mask-and-causal",
        "gqa-flag",
        "gqa-heads",
        "cross",
        "head-dim",
        "3d",
        "dtype",
        "zigzag-odd",
        "layout",
    ],
)
def test_bad_input(make, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ring_attention(*make(), **kwargs)


def test_shard_length_not_divisible():
    with pytest.raises(ValueError, match=r"pad or trim it to a multiple of 2"):
        shard(torch.randn(2, 5), 1, layout="zigzag")


def test_group_without_distributed():
    with pytest.raises(TypeError, match=r"must be a torch\.distributed\.ProcessGroup"):
        gather(torch.randn(4), 0, group=object())
    group = torch.distributed.ProcessGroup.__new__(torch.distributed.ProcessGroup)
    with pytest.raises(ValueError, match="not initialised"):
        gather(torch.randn(4), 0, group=group)


def disagreeing_ranks():
    import torch.distributed as dist

    seq = 8 if dist.get_rank() == 0 else 12  # rank 1 holds a longer shard
    q, k, v = qkv(seq=seq)
    ring_attention(q, k, v)


def test_ranks_disagree_on_shapes(ranks):
    """Mismatched shards raise on every rank instead of hanging the ring."""
    with pytest.raises(
        ValueError,
        match=r"disagree on their ring_attention call:\n  q: rank 0: \(\(1, 4, 8, 8\).*rank 1: \(\(1, 4, 12, 8\)",
    ):
        ranks(2).run(disagreeing_ranks, timeout=60)


def backend_cannot_serve():
    import torch.distributed as dist

    group = dist.new_group(backend="cuda:gloo")  # serves CUDA tensors only
    ring_attention(*qkv(), group=group)


def test_backend_cannot_serve_device(ranks):
    with pytest.raises(ValueError, match=r"cannot move cpu tensors"):
        ranks(2).run(backend_cannot_serve, timeout=60)


def mask_on_rank_0_only():
    import torch.distributed as dist

    q, k, v = qkv(seq=8)
    mask = torch.ones(1, 1, 8, 16, dtype=torch.bool) if dist.get_rank() == 0 else None
    return outcome(lambda: ring_attention(q, k, v, attn_mask=mask, layout="zigzag"))


def test_a_mask_passed_by_some_ranks_raises_on_every_rank(ranks):
    for kind, message, elapsed in ranks(2).run(mask_on_rank_0_only, timeout=30):
        assert kind == "ValueError" and "attn_mask: rank 0: ((1, 1, 8, 16)" in message, message
        assert elapsed < PG_TIMEOUT_S  # raised, not left waiting for the other rank


def dropout_on_rank_1():
    import torch.distributed as dist

    return outcome(lambda: ring_attention(*qkv(), dropout_p=0.1 * dist.get_rank()))


def test_a_rank_failing_its_own_validation_stops_every_rank(ranks):
    """Rank 1's error is raised on rank 1, and named on rank 0, at once: no wait for a timeout."""
    (kind0, message0, t0), (kind1, message1, t1) = ranks(2).run(dropout_on_rank_1, timeout=30)
    assert kind1 == "ValueError" and "does not support dropout" in message1
    assert kind0 == "RankFailed" and "rank 1: ValueError" in message0 and "dropout" in message0
    assert max(t0, t1) < 2.0


@pytest.mark.parametrize("shape", [(1, 0, 8, 4), (1, 2, 0, 4), (0, 2, 8, 4)])
def test_empty_inputs_name_the_cause(shape):
    with pytest.raises(ValueError, match="must not be empty"):
        ring_attention(*(torch.randn(shape) for _ in range(3)))
