"""A checkpoint is the dict of its parts: each saves and loads itself under its key, the
per-rank ones follow the world-size rules, the epoch is the loader's alone, and a loader says
its own state as of the last optimizer step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import TensorLoader
from torch import nn

from stallfree.train.checkpoint import SavedCheckpoint
from stallfree.train.checkpoint.format import upgrade
from stallfree.train.checkpoint.parts import MissingPartError, PerRank
from stallfree.train.ema import ModelEma
from stallfree.train.trainer import Trainer, TrainerConfig

CPU = torch.device("cpu")


def _trainer(ema: bool = False) -> Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 5))
    config = TrainerConfig(log_every=100, progress=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return Trainer(model, optimizer, config=config, device=CPU, ema=ModelEma(model, 0.9) if ema else None)


def _loader(n: int = 24) -> TensorLoader:
    return TensorLoader(torch.randn(n, 3, 4, 4), torch.randint(0, 5, (n,)), batch_size=4)


def test_a_loader_gives_back_the_batches_fetched_since_its_last_step() -> None:
    loader = _loader()
    batches = iter(loader)
    assert loader.state_at_last_step() == loader.state_dict()  # never marked: as it stands
    next(batches), next(batches)
    loader.mark_step()
    next(batches)  # fetched for a step that never ran
    assert (loader.state_dict()["position"], loader.state_at_last_step()["position"]) == (12, 8)
    loader.set_epoch(1)  # a new epoch with no step yet starts at its beginning
    assert (loader.state_at_last_step()["epoch"], loader.state_at_last_step()["position"]) == (1, 0)


def test_a_trainer_round_trips_through_its_parts() -> None:
    trained, fresh, loader = _trainer(ema=True), _trainer(ema=True), _loader()
    trained.train_batches(iter(loader), len(loader))
    state = trained.state_dict()
    assert set(state) == set(trained.parts()) == {
        "model", "optimizer", "scaler", "scheduler", "counters", "totals", "ema"
    }  # fmt: skip
    fresh.load_state_dict(state)
    assert fresh.optimizer_steps == trained.optimizer_steps == 6
    for key in ("model", "ema", "optimizer"):
        assert str(fresh.state_dict()[key]) == str(state[key]), key


def test_a_part_the_checkpoint_lacks_is_named() -> None:
    with pytest.raises(MissingPartError, match=r"no ema state.*train\.ema_decay") as caught:
        _trainer(ema=True).load_state_dict(_trainer().state_dict())
    assert "\n" not in str(caught.value)


class _Part:
    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def _per_rank(rank: int, world_size: int) -> tuple[PerRank, _Part, _Part, _Part]:
    loader, rng, interval = _Part(-1), _Part(-1), _Part(-1)
    parts = PerRank(rank, world_size, {"loader": loader}, {"rng": rng}, {"interval": interval})
    return parts, loader, rng, interval


def test_per_rank_parts_follow_the_world_size_rules() -> None:
    saved, loader, rng, interval = _per_rank(0, 1)
    loader.value, rng.value, interval.value = 5, 6, 7
    ranks = saved.state_dict()
    assert ranks == [{"loader": {"value": 5}, "rng": {"value": 6}, "interval": {"value": 7}}]
    same, *mine = _per_rank(0, 1)
    same.load_state_dict(ranks)
    assert [p.value for p in mine] == [5, 6, 7]
    grown, *first = _per_rank(0, 2)  # a rank the checkpoint had, in a larger world
    grown.load_state_dict(ranks)
    assert [p.value for p in first] == [5, 6, -1]  # its interval counted the old world's images
    new, *second = _per_rank(1, 2)  # a rank it did not have: positions are global samples
    new.load_state_dict(ranks)
    assert [p.value for p in second] == [5, -1, -1]


def test_the_epoch_is_kept_once_in_the_loaders_state() -> None:
    old = {
        "format": 4,
        "counters": {},
        "data": {},
        "epoch": 3,
        "ranks": [{"loader": {"epoch": 3, "position": 8}, "interval": {}}],
    }
    new = upgrade(old, "ckpt-000000008.pt")
    assert "epoch" not in new and SavedCheckpoint(new, Path("ckpt-000000008.pt")).epoch == 3
    best = upgrade({"format": 4, "model": {}, "epoch": 1, "recipe": {}}, "best.pt")
    assert best["epoch"] == 1  # best.pt's epoch is the one its weights are from


def test_the_manager_saves_every_n_steps_at_epoch_ends_and_best_when_improved(tmp_path: Path) -> None:
    """The save policy the run's hooks call (train/checkpoint/manager.py), over keep-last-2."""
    from stallfree.train.checkpoint import BEST, Checkpointer
    from stallfree.train.checkpoint.manager import CheckpointManager
    from stallfree.train.checkpoint.parts import StateFns

    seen = {"steps": 0}
    manager = CheckpointManager(
        Checkpointer(tmp_path, keep=2),
        {"model": StateFns(lambda: dict(seen), seen.update)},
        {"recipe": {}},
        every_steps=2,
        records=lambda: 7,
        best=lambda epoch: {"model": {}, "epoch": epoch},
    )
    for step in range(1, 6):
        seen["steps"] = step
        manager.on_step(step)
    assert [p.name for p in manager.checkpointer.paths()] == ["ckpt-000000004.pt", "ckpt-000000002.pt"]
    manager.on_epoch_end(5, epoch=0, improved=False)
    assert not (tmp_path / BEST).exists()
    manager.on_epoch_end(5, epoch=1, improved=True)
    assert SavedCheckpoint.read(tmp_path / BEST).epoch == 1
    saved = SavedCheckpoint.read(manager.newest())
    assert manager.newest().name == "ckpt-000000005.pt" and saved.metrics_records == 7
    seen["steps"] = 0
    manager.load(saved)  # a resume gives each part its state back
    assert seen["steps"] == 5
