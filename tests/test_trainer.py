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


def _dataset(steps: int):
    g = torch.Generator().manual_seed(0)
    return [
        {"input_ids": ids, "labels": ids}
        for ids in torch.randint(1, 64, (BATCH * 2 * steps, LENGTH), generator=g)
    ]


def _train(model, batch: int, trainer_class, steps=STEPS, callbacks=()) -> dict[str, torch.Tensor]:
    from transformers import TrainingArguments

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            out,
            per_device_train_batch_size=batch,
            max_steps=steps,
            learning_rate=1e-2,
            train_sampling_strategy="sequential",
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
        )
        trainer = trainer_class(
            model=model, args=args, train_dataset=_dataset(steps), callbacks=list(callbacks)
        )
        trainer.train()
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


def _logging_callback(logged: list):
    """A Trainer callback that logs each step's batch from a forward pre-hook on the model."""
    from transformers import TrainerCallback

    class LogBatches(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            model.register_forward_pre_hook(
                lambda m, a, kw: logged.append(kw["input_ids"].detach().clone()),
                with_kwargs=True,
            )

    return LogBatches()


def trainer_on_the_ring(dp: int, cp: int, steps: int = STEPS, logged: list | None = None):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Trainer

    class RingTrainer(Trainer):
        def _get_train_sampler(self, *args):
            sampler = super()._get_train_sampler(*args)
            return RingSampler(sampler, self.args.per_device_train_batch_size, cp)

    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    callbacks = () if logged is None else (_logging_callback(logged),)
    with _launched_as_by_torchrun():
        ring = ringify(_model(), ring_size=cp, mesh=mesh["cp"])
        return _train(ring, BATCH, RingTrainer, steps, callbacks)


def trainer_with_a_logging_callback(steps: int):
    logged = []
    return trainer_on_the_ring(1, dist.get_world_size(), steps, logged), logged


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


def test_a_callbacks_forward_pre_hook_sees_the_batch_and_training_is_unchanged(ranks):
    """A callback registers a pre-hook on the (ringified) model: it logs every step's batch,
    and 3 steps train the weights one process trains."""
    from transformers import Trainer

    steps = 3
    want = _train(_model(), BATCH, Trainer, steps)
    batches = torch.stack([row["input_ids"] for row in _dataset(steps)])
    for got, logged in ranks(2).run(trainer_with_a_logging_callback, steps):
        assert len(logged) == steps
        for batch in logged:  # each a batch of the dataset's rows, as Trainer passed it
            assert batch.shape == (BATCH, LENGTH)
            assert all((batches == row).all(1).any() for row in batch)
        for name in want:
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
