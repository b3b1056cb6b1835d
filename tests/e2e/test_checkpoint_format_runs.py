"""Checkpoint format: older files load, resume and evaluate; newer ones are refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_checkpoint_format import FORMAT_1, FORMAT_5, _fixture_recipe

import stallfree.data.autotune as autotune
from stallfree.recipe import dump_toml
from stallfree.train.checkpoint.format import FORMAT
from stallfree.train.run import train


@pytest.mark.e2e
def test_a_format_1_checkpoint_resumes_and_is_upgraded(
    image_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = _fixture_recipe(image_root, tmp_path, monkeypatch)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(FORMAT_1, run / "checkpoints" / FORMAT_1.name.removeprefix("format1-"))
    summary = train(recipe, run, progress=False, resume="auto")
    assert summary["optimizer_steps"] == 6 and summary["segments"] == 2
    steps = [json.loads(line).get("step") for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[0] == 2 and steps[-1] == 6  # continued after the checkpoint's step, none repeated
    written = torch.load(run / "checkpoints" / "ckpt-000000006.pt", weights_only=True)
    assert written["format"] == FORMAT


@pytest.mark.e2e
def test_a_format_5_checkpoint_resumes_with_the_count_auto_chose(
    image_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its run's recipe, as given ("auto" everywhere), resumes from it: the worker count is
    the one its start measured (3), not measured again, and the new files say so."""
    recipe = _fixture_recipe(image_root, tmp_path, monkeypatch, auto=True)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(FORMAT_5, run / "checkpoints" / FORMAT_5.name.removeprefix("format5-"))
    monkeypatch.setattr(autotune, "_measure", lambda *a: pytest.fail("measured on resume"))
    summary = train(recipe, run, progress=False, resume="auto")
    assert summary["optimizer_steps"] == 6 and summary["backend"] == "torch"
    assert (run / "recipe.toml").read_text() == dump_toml(recipe)
    written = torch.load(run / "checkpoints" / "ckpt-000000006.pt", weights_only=True)
    assert written["recipe"] == recipe.to_dict() and written["resolved"]["workers"] == 3
