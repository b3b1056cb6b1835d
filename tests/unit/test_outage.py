"""A store outage in the middle of an accumulation window (the trainer's bookkeeping; the real
server's outage is in test_store_faults.py): the checkpoint's position gives back the micro-batches
fetched for the step that never ran, so the resumed run equals an uninterrupted one, bitwise."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from helpers import TensorLoader
from torch import nn

from stallfree.data.loader import Batch
from stallfree.data.storage import StoreUnavailableError
from stallfree.train.checkpoint.parts import StepMark
from stallfree.train.outage import StoreOutage, outage_as_stop
from stallfree.train.trainer import Trainer, TrainerConfig, TrainerHooks

CPU = torch.device("cpu")


def _trainer() -> Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    config = TrainerConfig(accum_steps=2, log_every=100, progress=False)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), config=config, device=CPU)


def _failing(loader: TensorLoader, at: int) -> Iterator[Batch]:
    """The loader's batches until the `at`-th, whose read meets a store that stayed down."""
    batches = iter(loader)
    for _ in range(at):
        yield next(batches)
    # Raised where a loader's read raises: before it counts the batch as taken.
    raise StoreUnavailableError("s3://b/train/x.jpg: Could not connect (still after 3 s)")


def test_an_outage_mid_window_resumes_at_the_last_step() -> None:
    g = torch.Generator().manual_seed(1)
    images, labels = torch.randn(24, 3, 8, 8, generator=g), torch.randint(0, 5, (24,), generator=g)
    expected = _trainer()
    whole = TensorLoader(images, labels, batch_size=4)  # 6 micro-batches: 3 steps of 2
    expected.train_batches(iter(whole), len(whole))

    trainer, loader = _trainer(), TensorLoader(images, labels, batch_size=4)
    mark = StepMark(loader)  # as the run keeps it: moved on after every optimizer step
    hooks = TrainerHooks(on_step=lambda _: mark.step())
    with pytest.raises(StoreOutage, match=r"s3://b/train/x.jpg: .*\(still after 3 s\)") as stop:
        with outage_as_stop():  # batch 2 fetched, never stepped
            trainer.train_batches(_failing(loader, at=3), len(loader), hooks=hooks)
    assert trainer.optimizer_steps == 1 and loader.position == 12
    mark.rewind = isinstance(stop.value, StoreOutage)  # as the run sets it on the stop
    state = mark.state_dict()
    assert state["position"] == 8  # the one step's two micro-batches of 4

    loader.load_state_dict(state)  # what a resume does, with the trainer's state as saved
    trainer.train_batches(iter(loader), loader.batches_left(), total=len(loader))
    assert trainer.optimizer_steps == 3
    for mine, theirs in zip(trainer.model.state_dict().values(), expected.model.state_dict().values()):
        assert torch.equal(mine, theirs)


def test_an_outage_after_an_epoch_s_last_step_resumes_at_the_next_epoch() -> None:
    """Met in validation, or on the next epoch's first fetch: that epoch's start, not the end."""
    loader = TensorLoader(torch.zeros(8, 3, 8, 8), torch.zeros(8, dtype=torch.int64), batch_size=4)
    mark = StepMark(loader)
    for _ in loader:
        mark.step()
    loader.set_epoch(1)  # as fit() does before validating
    mark.rewind = True  # a store outage, met in validation
    state = mark.state_dict()
    assert (state["epoch"], state["position"]) == (1, 0)
