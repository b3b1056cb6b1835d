"""Checkpoint format: older files load, resume and evaluate; newer ones are refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import small_recipe

from stallfree.recipe import Recipe, recipe_from_dict
from stallfree.resolved import Resolved
from stallfree.train.checkpoint import load_checkpoint
from stallfree.train.checkpoint.format import FORMAT, CheckpointFormatError, upgrade
from stallfree.train.evaluate import evaluate_checkpoint
from stallfree.train.run import train

# Written by stallfree 0.3.0 before checkpoints carried a format (see its README).
FORMAT_1 = Path(__file__).parents[1] / "data" / "checkpoints" / "format1-ckpt-000000001.pt"
# Written by stallfree 0.4.0, the last format whose recipe held what each "auto" became.
FORMAT_5 = Path(__file__).parents[1] / "data" / "checkpoints" / "format5-ckpt-000000001.pt"


def _fixture_recipe(
    image_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, auto: bool = False
) -> Recipe:
    """The recipe that wrote FORMAT_1 (`auto`: FORMAT_5), over the same demo data under the
    same relative root."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").symlink_to(image_root)
    asked = {"precision": "auto", "device": "auto"} if auto else {}
    return small_recipe(
        "demo",
        optim={"name": "sgd", "lr": 0.05, "momentum": 0.0, "weight_decay": 0.0},
        train={"epochs": 2, "batch_size": 16, "ckpt_every_steps": 1, "keep_checkpoints": 10, **asked},
        loader={"backend": "auto", "torch": {"workers": "auto"}} if auto else {},
    )


def test_a_format_1_checkpoint_evaluates(
    image_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = _fixture_recipe(image_root, tmp_path, monkeypatch)
    result = evaluate_checkpoint(recipe, FORMAT_1)
    assert result["samples"] == 30 and 0.0 <= result["val_top1"] <= 1.0


def test_upgrade_sets_the_defaults_of_keys_older_files_lack() -> None:
    state = load_checkpoint(FORMAT_1)
    assert state["format"] == FORMAT
    assert state["counters"]["best_val_top1"] == -1.0 and state["segments"]["count"] == 1
    # As a 0.2 file: no best_val_top1, totals or segments; the epoch in the counters; a DALI
    # state from the file-reader pipeline (marked by dali_list_start), which does not apply.
    old = torch.load(FORMAT_1, weights_only=True)
    for key in ("totals", "segments", "num_classes", "class_names", "metrics_records"):
        old.pop(key, None)
    old["counters"] = {**old["counters"], "epoch": 0}
    del old["counters"]["best_val_top1"]
    old["ranks"][0]["loader"] |= {"dali": "{}", "dali_list_start": 0}
    new = upgrade(old, FORMAT_1)
    assert new["format"] == FORMAT
    assert new["counters"]["best_val_top1"] == -1.0 and "epoch" not in new["counters"]
    assert new["totals"] == {"images": 0, "wall_s": 0.0, "wait_s": 0.0}
    assert new["segments"] == {"wall_s": 0.0, "count": 0} and new["num_classes"] == 0
    assert new["class_names"] == [] and new["metrics_records"] == 0
    assert not {"dali", "dali_list_start"} & set(new["ranks"][0]["loader"])
    best = upgrade({"model": {}, "epoch": 0, "recipe": {}}, FORMAT_1)  # a best.pt: weights only
    assert best["format"] == FORMAT and "counters" not in best


def test_a_format_5_recipe_is_upgraded_to_the_one_given_and_its_record() -> None:
    """Format 5 kept what each "auto" became in the recipe, `<key>_requested` beside it: the
    upgrade gives back the recipe as given, and those values as the Resolved record."""
    state = load_checkpoint(FORMAT_5)
    assert state["upgraded_from"] == 5 and "_requested" not in str(state["recipe"])
    recipe = recipe_from_dict(state["recipe"])
    asked = (recipe.loader.backend, recipe.loader.io_depth, recipe.loader.torch.workers)
    assert asked + (recipe.train.precision, recipe.train.device) == ("auto",) * 5
    resolved = Resolved.from_dict(state["resolved"], str(FORMAT_5))
    decided = (resolved.backend, resolved.device, resolved.precision, resolved.io_depth)
    assert decided == ("torch", "cpu", "bf16", 16) and (resolved.workers, resolved.threads) == (3, 0)


def test_upgrade_drops_a_loaders_own_random_state() -> None:
    """Loaders keep positions only (each sample's draws come from its seed): a format-3 file's
    DALI state is dropped, its positions kept."""
    old = {
        "format": 3,
        "counters": {},
        "data": {},
        "ranks": [{"loader": {"epoch": 1, "position": 8, "dali": "{}"}}],
    }
    new = upgrade(old, "ckpt-000000008.pt")
    assert new["format"] == FORMAT and new["upgraded_from"] == 3
    assert new["ranks"][0]["loader"] == {"epoch": 1, "position": 8}


def test_a_newer_format_is_refused_in_one_line(
    image_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = _fixture_recipe(image_root, tmp_path, monkeypatch)
    state = torch.load(FORMAT_1, weights_only=True)
    state["format"] = FORMAT + 1
    path = tmp_path / "run" / "checkpoints" / "ckpt-000000001.pt"
    path.parent.mkdir(parents=True)
    torch.save(state, path)
    with pytest.raises(CheckpointFormatError) as caught:
        load_checkpoint(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message
    assert f"format {FORMAT + 1}" in message and "upgrade stallfree" in message
    # A resume must not skip it for an older checkpoint: that would go back in the run.
    with pytest.raises(CheckpointFormatError, match="upgrade stallfree"):
        train(recipe, tmp_path / "run", progress=False, resume="auto")
