"""HF Trainer trains a ringified model as it trains the model: 2 AdamW steps on a ring of 2
ranks, and on a (dp, cp) = (2, 2) mesh under Trainer's own DDP, against one process
training on the global batch (every weight after the steps)."""

from __future__ import annotations

import contextlib
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from ringify import RingSampler, ringify
from ringify.testing.hf_models import llama

pytest.importorskip("accelerate")

BATCH, STEPS, LENGTH = 2, 2, 16


def _dataset():
    g = torch.Generator().manual_seed(0)
    return [
        {"input_ids": ids, "labels": ids}
        for ids in torch.randint(1, 64, (BATCH * 2 * STEPS, LENGTH), generator=g)
    ]


def _train(model, batch: int, trainer_class) -> dict[str, torch.Tensor]:
    from transformers import TrainingArguments

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            out,
            per_device_train_batch_size=batch,
            max_steps=STEPS,
            learning_rate=1e-2,
            train_sampling_strategy="sequential",
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
        )
        trainer_class(model=model, args=args, train_dataset=_dataset()).train()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@contextlib.contextmanager
def _launched_as_by_torchrun():
    """The environment torchrun gives a rank (accelerate reads it; the process group exists),
    and a fresh accelerate state; both undone after, for the next test on this rank."""
    from accelerate.state import AcceleratorState, PartialState

    saved = dict(os.environ)
    rank, world = str(dist.get_rank()), str(dist.get_world_size())
    os.environ.update(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    try:
        yield
    finally:
        AcceleratorState._reset_state(True)
        PartialState._reset_state()
        os.environ.clear()
        os.environ.update(saved)


def _model():
    torch.manual_seed(0)
    return llama().double()


def trainer_on_the_ring(dp: int, cp: int):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Trainer

    class RingTrainer(Trainer):
        def _get_train_sampler(self, *args):
            sampler = super()._get_train_sampler(*args)
            return RingSampler(sampler, self.args.per_device_train_batch_size, cp)

    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    with _launched_as_by_torchrun():
        return _train(ringify(_model(), ring_size=cp, mesh=mesh["cp"]), BATCH, RingTrainer)


@pytest.mark.parametrize("dp, cp", [(1, 2), (2, 2)])
def test_trainer_trains_the_ringified_model_as_the_model(ranks, dp, cp):
    from transformers import Trainer

    want = _train(_model(), BATCH * dp, Trainer)
    initial = dict(_model().named_parameters())
    for got in ranks(dp * cp).run(trainer_on_the_ring, dp, cp):
        assert got.keys() == want.keys()
        for name in want:
            assert not torch.equal(want[name], initial[name]), name  # it trained
            torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-10)


def trainer_without_ring_sampler():
    from transformers import Trainer

    from ringify.testing import outcome

    with _launched_as_by_torchrun():
        ring = ringify(_model(), ring_size=dist.get_world_size())
        return outcome(lambda: _train(ring, BATCH, Trainer))


def test_trainer_dealing_each_rank_its_own_batch_is_refused_on_every_rank(ranks):
    for kind, message, _ in ranks(2).run(trainer_without_ring_sampler):
        assert kind == "ValueError" and "RingSampler" in message, message
