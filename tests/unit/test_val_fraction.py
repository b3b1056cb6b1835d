"""`data.val_fraction`: a root without val/ holds out a seeded, class-stratified share of train
for validation, recorded in the run; without the key such a root is refused, naming it."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest
from helpers import small_recipe

import stallfree
from stallfree.data.readers.factory import resolve_dataset
from stallfree.data.readers.folders import DatasetError
from stallfree.data.readers.paths import check_paths
from stallfree.data.storage import NoDataError
from stallfree.recipe import DataConfig, RecipeError, dump_toml

BACKENDS = ["torch", pytest.param("dali", marks=pytest.mark.dali)]


@pytest.fixture
def train_only(image_root: Path, tmp_path: Path) -> Path:
    """The demo data's train/ alone (10 classes x 6 images), no val/."""
    shutil.copytree(image_root / "train", tmp_path / "data" / "train")
    return tmp_path / "data"


def test_a_root_without_val_is_refused_naming_val_fraction(train_only: Path) -> None:
    with pytest.raises(NoDataError, match=r"no val/ folder.*data\.val_fraction"):
        resolve_dataset(DataConfig(root=str(train_only)))
    with pytest.raises(RecipeError, match=r"no val/ folder.*data\.val_fraction"):
        check_paths(small_recipe(train_only))
    check_paths(small_recipe(train_only, data={"val_fraction": 0.2}))  # with the key: accepted


def test_held_out_share_is_stratified_seeded_and_disjoint(train_only: Path) -> None:
    data = DataConfig(root=str(train_only), val_fraction=0.34)
    dataset = resolve_dataset(data, seed=0)
    train, val = (set(dataset.splits[s].files) for s in ("train", "val"))
    everything = {str(p) for p in (train_only / "train").rglob("*.*")}
    assert not train & val and train | val == everything
    assert Counter(dataset.splits["val"].labels.tolist()) == dict.fromkeys(range(10), 2)  # 6 x 0.34
    assert dataset.classes == tuple(sorted(p.name for p in (train_only / "train").iterdir()))
    again = resolve_dataset(data, seed=0)
    assert again.splits["val"].files == dataset.splits["val"].files
    assert again.splits["train"].files == dataset.splits["train"].files
    assert resolve_dataset(data, seed=1).splits["val"].files != dataset.splits["val"].files


def test_val_fraction_beside_a_val_folder_is_refused(image_root: Path) -> None:
    with pytest.raises(DatasetError, match="val_fraction"):
        resolve_dataset(DataConfig(root=str(image_root), val_fraction=0.1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_both_loaders_read_the_held_out_share(train_only: Path, tmp_path: Path, backend: str) -> None:
    """val reads exactly the held-out files (every one, once); train never reads them."""
    recipe = small_recipe(train_only, data={"val_fraction": 0.34}, loader={"backend": backend})
    path = tmp_path / "r.toml"
    path.write_text(dump_toml(recipe))
    held = resolve_dataset(recipe.data, seed=recipe.train.seed).splits["val"]
    with stallfree.loader(path, "val") as val:
        labels = [label for batch in val for label in batch.labels.tolist()]
    assert sorted(labels) == sorted(held.labels.tolist()) and len(labels) == 20
    with stallfree.loader(path, "train", train__batch_size=5) as train:
        assert len(train) == 40 // 5  # 60 - 20 held out
