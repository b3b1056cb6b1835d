"""`data.val_fraction`: a root without val/ holds out a seeded, class-stratified share of train
for validation, recorded in the run; without the key such a root is refused, naming it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import small_recipe

from stallfree.data.readers.factory import resolve_dataset
from stallfree.recipe import load_recipe


@pytest.fixture
def train_only(image_root: Path, tmp_path: Path) -> Path:
    """The demo data's train/ alone (10 classes x 6 images), no val/."""
    shutil.copytree(image_root / "train", tmp_path / "data" / "train")
    return tmp_path / "data"


@pytest.mark.slow  # a (tiny) training run: ~11 s on 2 cores
def test_the_run_records_the_held_out_files(train_only: Path, tmp_path: Path) -> None:
    from stallfree.train.run import train

    recipe = small_recipe(train_only, data={"val_fraction": 0.34}, train={"batch_size": 20})
    train(recipe, tmp_path / "run", progress=False)
    assert load_recipe(tmp_path / "run" / "recipe.toml").data.val_fraction == 0.34
    lines = (tmp_path / "run" / "val_holdout.txt").read_text().splitlines()
    held = [line for line in lines if not line.startswith("#")]
    expected = resolve_dataset(recipe.data, seed=recipe.train.seed).splits["val"].files
    assert [str(train_only / line) for line in held] == expected
    assert "20 files" in lines[0]
