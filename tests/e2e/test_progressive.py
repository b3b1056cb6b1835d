"""Progressive resizing (augment.image_size as [epoch, size] pairs) and the test-time size."""

from __future__ import annotations

import inspect
import shutil
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import build_loader, small_recipe

from stallfree.recipe import AugmentConfig
from stallfree.train.checkpoint import load_checkpoint
from stallfree.train.run import train

pytestmark = pytest.mark.e2e  # every test here trains a run or starts a process

CPU = torch.device("cpu")
BACKENDS = ["torch", pytest.param("dali", marks=pytest.mark.dali)]
SCHEDULE = {"image_size": [[0, 32], [1, 48]], "val_image_size": 40, "resize_size": 44}


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_epoch_has_its_size_and_val_its_own(image_root: Path, backend: str) -> None:
    recipe = small_recipe(image_root, augment=SCHEDULE, loader={"backend": backend})
    loader = build_loader(recipe, "train", device=CPU)
    try:
        for epoch, side in ((0, 32), (1, 48), (2, 48), (0, 32)):  # and back: a fresh epoch 0
            loader.set_epoch(epoch)
            shapes = {tuple(b.images.shape[1:]) for b in loader}
            assert shapes == {(3, side, side)}, (epoch, shapes)
    finally:
        loader.close()
    val = build_loader(recipe, "val", device=CPU)
    assert {tuple(b.images.shape[1:]) for b in val} == {(3, 40, 40)}
    val.close()


def test_resume_across_a_size_change_is_bitwise(image_root: Path, tmp_path: Path) -> None:
    recipe = small_recipe(
        image_root,
        augment=SCHEDULE,
        optim={"name": "sgd", "lr": 0.05},
        train={"epochs": 2, "ckpt_every_steps": 1, "keep_checkpoints": 20},
    )
    full = tmp_path / "full"
    train(recipe, full, progress=False)
    run = tmp_path / "resumed"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(full / "checkpoints" / "ckpt-000000009.pt", run / "checkpoints")  # epoch 1, 48 px
    train(recipe, run, progress=False, resume="auto")
    final, resumed = (load_checkpoint(d / "checkpoints" / "ckpt-000000014.pt")["model"] for d in (full, run))
    assert all(torch.equal(final[k], resumed[k]) for k in final)


def test_the_ffcv_recipe_trains_a_step_at_each_size(image_root: Path) -> None:
    """pipelines/imagenet-resnet50-16ep.toml's schedule (160 px, then 192 from epoch 12; val at
    256) on small images: one CPU step at each train size, the val size checked."""
    from helpers import one_step_trainer

    from stallfree.recipe import load_recipe

    path = Path(__file__).parents[2] / "pipelines" / "imagenet-resnet50-16ep.toml"
    recipe = load_recipe(path)
    assert recipe.augment.image_size == [[0, 160], [12, 192]] and recipe.augment.val_size == 256
    ctx, loader, trainer = one_step_trainer(
        path,
        image_root,
        [
            "augment.image_size=[[0, 32], [12, 40]]",
            "augment.val_image_size=48",
            "augment.resize_size=55",
            "train.channels_last=false",
        ],
    )
    for epoch, side in ((0, 32), (12, 40)):
        loader.set_epoch(epoch)
        batch = next(iter(loader))
        assert batch.images.shape[-1] == side
        trainer.train_batches(islice(iter(loader), 1), 1)
    assert trainer.optimizer_steps == 2
    val = ctx.loader("val")
    assert next(iter(val)).images.shape[-1] == 48
    val.close()
    loader.close()


def _transforms() -> list[Any]:
    from stallfree.data.backends.naive import naive_train, naive_val
    from stallfree.data.transforms.augment import train_transform, val_transform

    return [train_transform, val_transform, naive_train, naive_val]


@pytest.mark.parametrize("index", range(4), ids=["train", "val", "naive_train", "naive_val"])
def test_transforms_crop_to_the_side_they_are_given(tmp_path: Path, index: int) -> None:
    """augment.image_size is the schedule only: a transform is given this epoch's side as an int
    (here one the schedule never names) and crops to it, whatever the schedule says."""
    from PIL import Image

    path = tmp_path / "a.jpg"
    Image.new("RGB", (64, 56), (200, 40, 90)).save(path)
    aug = AugmentConfig(image_size=[[0, 32], [1, 48]], resize_size=44)
    out = _transforms()[index](str(path), aug, 40, 7)
    assert sorted(out.shape) == [3, 40, 40]


def test_one_crop_size_per_epoch_on_the_spec() -> None:
    """One name, one meaning: the loader spec answers `crop_size(epoch)`; no loader carries a
    second crop_size with other arguments."""
    from stallfree.data.backends.torch_backend import TorchLoader
    from stallfree.data.loader import LoaderSpec

    assert list(inspect.signature(LoaderSpec.crop_size).parameters) == ["self", "epoch"]
    assert not hasattr(TorchLoader, "crop_size")
