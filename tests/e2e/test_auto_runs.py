"""--loader auto (the fallback chain), workers/threads = "auto", and synthetic-decode."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import small_recipe

import stallfree.data.autotune as autotune
from stallfree.recipe import load_recipe, tomllib
from stallfree.resolved import Resolved
from stallfree.train.prepare import prepare
from stallfree.train.run import train


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["torch", pytest.param("dali", marks=pytest.mark.dali)])
def test_auto_counts_are_measured_and_kept(
    image_root: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = "workers" if backend == "torch" else "threads"
    recipe = small_recipe(image_root, loader={"backend": backend, backend: {table: "auto"}})
    # A run measures once, at its start; its loaders, val too, are built with that count.
    ctx = prepare(recipe).with_loader_counts()
    figures = ctx.autotune
    assert figures is not None and figures["key"] == f"loader.{backend}.{table}"
    assert set(figures["images_per_s"]) == {str(n) for n in autotune.candidates(1)}
    assert all(rate > 0 for rate in figures["images_per_s"].values())
    assert str(figures["chosen"]) == max(figures["images_per_s"], key=figures["images_per_s"].get)
    monkeypatch.setattr(autotune, "_measure", lambda *a: pytest.fail("measured twice"))
    for split in ("train", "val"):
        with ctx.loader(split) as loader:
            assert len(list(loader)) == len(loader)


@pytest.mark.e2e
def test_a_run_records_what_auto_chose_and_a_resume_reuses_it(
    image_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = small_recipe(
        image_root, train={"batch_size": 16, "ckpt_every_steps": 1}, loader={"torch": {"workers": "auto"}}
    )
    train(recipe, tmp_path / "run", progress=False)
    figures = json.loads((tmp_path / "run" / "autotune.json").read_text())
    assert figures["key"] == "loader.torch.workers" and figures["chosen"] in (1, 2, 3)
    # The run's recipe is the one given; resolved.toml says what "auto" chose.
    assert load_recipe(tmp_path / "run" / "recipe.toml").loader.torch.workers == "auto"
    assert _resolved(tmp_path / "run").workers == figures["chosen"]
    # A resume of the same "auto" recipe (here: from the first step's checkpoint, into a new
    # directory) takes the count from the checkpoint: no second measurement.
    monkeypatch.setattr(autotune, "_measure", lambda *a: pytest.fail("measured on resume"))
    first = sorted(
        (tmp_path / "run" / "checkpoints").glob("ckpt-*.pt"), key=lambda p: int(p.stem.split("-")[1])
    )[0]
    train(recipe, tmp_path / "resumed", progress=False, resume=str(first))
    assert _resolved(tmp_path / "resumed").workers == figures["chosen"]


def _resolved(run: Path) -> Resolved:
    """A run directory's resolved.toml."""
    return Resolved.from_dict(tomllib.loads((run / "resolved.toml").read_text()), "resolved.toml")


@pytest.mark.e2e
def test_eval_measures_auto_once_in_prepare_and_its_loader_uses_it(
    image_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """eval (and the bench's measurements) prepare their run as train does: "auto" is timed
    once, on the train split, before any loader; the val loader is built with that count."""
    from stallfree.models import build_model
    from stallfree.train.evaluate import evaluate_checkpoint

    recipe = small_recipe(image_root, loader={"torch": {"workers": "auto"}})
    checkpoint = tmp_path / "weights.pt"
    torch.save({"model": build_model(recipe.model, 10).state_dict()}, checkpoint)
    measured: list[str] = []
    real = autotune._measure  # noqa: SLF001 - a spy on the measurement itself

    def counted(spec: Any, backend: Any) -> Any:
        measured.append(spec.split)
        return real(spec, backend)

    monkeypatch.setattr(autotune, "_measure", counted)
    result = evaluate_checkpoint(recipe, checkpoint)
    assert measured == ["train"] and result["samples"] == 30
