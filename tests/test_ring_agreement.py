"""Ranks that disagree raise together, before any collective could time out, with an error
that names the cause.

Each job returns every rank's ``outcome`` (the exception's type and message, and how
long the rank took), so a test sees that *every* rank raised, not only the first.
"""

from __future__ import annotations

import pytest
import torch

from ringify import ringify
from ringify.testing import outcome
from ringify.testing.hf_models import gpt2
from ringify.testing.models import NanoGPT
from ringify.testing.ranks import PG_TIMEOUT_S

# A disagreement ends every rank before the process group's timeout, the moment a rank left
# waiting in a collective would raise: a bound set by the same run's ranks, not by how fast
# this machine is.
WITHIN_S = PG_TIMEOUT_S


def _batch(seed: int, seq: int = 16):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (2, seq), generator=g), torch.randint(0, 64, (2, seq), generator=g)


def _nanogpt(seed: int = 0, **kwargs):
    import torch.distributed as dist

    torch.manual_seed(seed)
    return ringify(NanoGPT().double(), ring_size=dist.get_world_size(), **kwargs)


def different_batches(first_call_agrees: bool, check_inputs: bool = True):
    """Each rank draws its own batch: a sampler split over all ranks instead of over rings."""
    import torch.distributed as dist

    model = _nanogpt(check_inputs=check_inputs)
    if first_call_agrees:
        model(*_batch(0)).__getitem__(1).backward()  # a trusted first step, then a bad one
    return outcome(lambda: model(*_batch(100 + dist.get_rank())))


def assert_every_rank_raised(outcomes, error: str, *fragments: str) -> None:
    for rank, (kind, message, elapsed) in enumerate(outcomes):
        assert kind == error, (rank, kind, message)
        for fragment in fragments:
            assert fragment in message, (rank, fragment, message)
        assert elapsed < WITHIN_S, (rank, elapsed)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("first_call_agrees", [False, True])
def test_ranks_given_different_batches_raise(ranks, world, first_call_agrees):
    outcomes = ranks(world).run(different_batches, first_call_agrees)
    assert_every_rank_raised(
        outcomes, "ValueError", "inputs", "args[0]", "args[1]", "DistributedSampler"
    )


def test_input_check_can_be_turned_off(ranks):
    """check_inputs=False skips the per-call collective (the user vouches for the data)."""
    assert [o[0] for o in ranks(2).run(different_batches, True, False)] == ["ok", "ok"]


def lengths_16_and_15():
    """Both lengths pad to the same local length: only the signature tells them apart."""
    import torch.distributed as dist

    model = _nanogpt()
    return outcome(lambda: model(*_batch(0, seq=16 - dist.get_rank())))


def test_ranks_given_different_lengths_raise(ranks):
    assert_every_rank_raised(
        ranks(2).run(lengths_16_and_15), "ValueError", "input shapes", "[2, 16] int64"
    )


def skipped_step():
    """Rank 1 catches an error before step 1 and goes on: it is one batch ahead."""
    import torch.distributed as dist

    model = _nanogpt()
    batches = [0, 1, 2] if dist.get_rank() == 0 else [0, 2, 3]  # batch 1's step was skipped
    for batch in batches:
        step = outcome(lambda b=batch: model(*_batch(b))[1].backward())
        if step[0] != "ok":
            break
    return step


def test_a_skipped_step_raises(ranks):
    assert_every_rank_raised(ranks(2).run(skipped_step), "ValueError", "inputs")


def different_seeds():
    import torch.distributed as dist

    model = _nanogpt(seed=dist.get_rank())
    return outcome(lambda: model(*_batch(0)))


def test_ranks_with_different_parameters_raise(ranks):
    assert_every_rank_raised(ranks(2).run(different_seeds), "ValueError", "parameters", "same seed")


def outputs_mode_differs():
    import torch.distributed as dist

    model = _nanogpt(outputs="full" if dist.get_rank() == 0 else "sharded")
    return outcome(lambda: model(*_batch(0)))


def test_ranks_configured_differently_raise(ranks):
    assert_every_rank_raised(
        ranks(2).run(outputs_mode_differs), "ValueError", "configuration", "full", "sharded"
    )


def mask_on_rank_0_only():
    import torch.distributed as dist

    torch.manual_seed(0)
    model = ringify(gpt2().double(), ring_size=dist.get_world_size())
    ids, labels = _batch(0)
    kwargs = {"input_ids": ids, "labels": labels}
    if dist.get_rank() == 0:
        kwargs["attention_mask"] = torch.ones_like(ids)
    return outcome(lambda: model(**kwargs))


def test_a_mask_passed_by_some_ranks_raises(ranks):
    assert_every_rank_raised(ranks(2).run(mask_on_rank_0_only), "ValueError", "input structure")


class FailsOnRank1(torch.nn.Module):
    """A model whose trace fails on rank 1 only (its own validation, say)."""

    def __init__(self):
        super().__init__()
        self.inner = NanoGPT().double()

    def forward(self, idx, targets):
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise ValueError("rank 1 rejects its input")
        return self.inner(idx, targets)


def trace_fails_on_rank_1():
    import torch.distributed as dist

    model = ringify(FailsOnRank1(), ring_size=dist.get_world_size())
    return outcome(lambda: model(*_batch(0)))


def test_a_rank_whose_trace_fails_stops_every_rank(ranks):
    outcomes = ranks(2).run(trace_fails_on_rank_1)
    assert outcomes[1][0] == "RuntimeError" and "rank 1 rejects" in outcomes[1][1]
    assert outcomes[0][0] == "RankFailed" and "rank(s) [1]" in outcomes[0][1], outcomes[0]
    assert "rank 1 rejects its input" in outcomes[0][1]
    assert all(elapsed < WITHIN_S for *_, elapsed in outcomes)


def collectives_per_call():
    """How many agreement collectives a ringified forward makes: one per call, none per layer."""
    from unittest import mock

    import torch.distributed as dist

    from ringify.runtime.collectives import agreement

    model = _nanogpt()  # two attention layers
    with mock.patch.object(
        agreement.dist, "all_gather_single", wraps=dist.all_gather_single
    ) as gathers:
        model(*_batch(0))  # the first call: the call and the new trace
        first = gathers.call_count
        model(*_batch(1))
        model(*_batch(2))
    return first, gathers.call_count - first


def test_agreement_is_once_per_call_not_per_attention(ranks):
    assert ranks(2).run(collectives_per_call) == [(2, 2), (2, 2)]


def _results(model, run, ids, mask) -> dict[str, torch.Tensor]:
    """Logits, loss and every parameter's gradient of one step of ``run``."""
    model.zero_grad()
    out = run(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"logits": out.logits.detach(), "loss": out.loss.detach(), **grads}


def hybrid_layer_types(name: str):
    """An HF model with full and sliding-window layers, whose RoPE tables are built in ``set``
    order, at a length the ring pads, with a padded batch row: (this rank's iteration order
    of the layer types, the results that differ from the unmodified model's beyond their
    tolerance). Gemma's norms compute in float32 even in a float64 model: their weights'
    gradients, and HF's float32 loss, are held to the unmodified model's own difference with
    its batch rows swapped (``ringify.testing.tolerance``)."""
    import torch.distributed as dist

    from ringify.testing import hf_models
    from ringify.testing.tolerance import differences, exceeding, reordering_tolerances

    torch.manual_seed(0)
    model = getattr(hf_models, name)().double()
    seq = 4 * dist.get_world_size() + 1  # odd: padded to the ring
    ids = torch.randint(1, 64, (2, seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, seq - 3 :] = 0
    want = _results(model, model, ids, mask)
    swapped = _results(model, model, ids.flip(0), mask.flip(0))
    swapped["logits"] = swapped["logits"].flip(0)
    got = _results(model, ringify(model, ring_size=dist.get_world_size()), ids, mask)
    wrong = exceeding(differences(got, want), reordering_tolerances(want, swapped))
    return list({"full_attention", "sliding_attention"}), wrong


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["modernbert", "gemma3"])
def test_ranks_with_different_hash_seeds_trace_one_computation(ranks, world, name):
    """torchrun's ranks draw their own hash seeds: their graphs list the RoPE tables in another
    order, and the ranks still agree, and are exact."""
    results = ranks(world).run(hybrid_layer_types, name)
    assert len({tuple(order) for order, _ in results}) > 1  # the ranks iterate differently
    for _, wrong in results:
        assert wrong == {}, wrong


class ScaledLogits(torch.nn.Module):
    """NanoGPT whose logits are scaled by a Python constant: not a parameter, not an input,
    so only the traced graph shows it."""

    def __init__(self, factor: float):
        super().__init__()
        self.inner, self.factor = NanoGPT().double(), factor

    def forward(self, idx, targets):
        logits, loss = self.inner(idx, targets)
        return logits * self.factor, loss


def constant_per_rank():
    import torch.distributed as dist

    torch.manual_seed(0)
    model = ScaledLogits(1.5 if dist.get_rank() == 1 else 1.0)
    ringified = ringify(model, ring_size=dist.get_world_size())
    return outcome(lambda: ringified(*_batch(0)))


def test_a_constant_that_differs_on_one_rank_is_caught(ranks):
    """The digest is blind to node order, not to a constant: every rank raises, at once."""
    assert_every_rank_raised(ranks(2).run(constant_per_rank), "ValueError", "graph", "report")
