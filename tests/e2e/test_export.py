"""`stallfree export`: a state dict, a torch.export program (model.pt2) and ONNX that compute the
model's logits, a one-line hint where ONNX's packages are missing, and a fine-tune that starts
from the exported weights."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from doc_pages import pages, python_blocks
from emulators import unavailable
from helpers import small_recipe

from stallfree.cli import main
from stallfree.models import build_model
from stallfree.recipe import Recipe
from stallfree.train.run import train

pytestmark = pytest.mark.e2e  # every test here trains a run

ONNX_HINT = "pip install -e '.[onnx]'"


@pytest.fixture(scope="module")
def trained(image_root: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Recipe, Path]:
    """(recipe, best.pt) of a 1-epoch run on the 10-class test data."""
    recipe = small_recipe(image_root)
    run = tmp_path_factory.mktemp("export") / "run"
    train(recipe, run, progress=False)
    return recipe, run / "checkpoints" / "best.pt"


def _exported_model(recipe: Recipe, out: Path) -> torch.nn.Module:
    model = build_model(recipe.model, 10)
    model.load_state_dict(torch.load(out / "state_dict.pt", weights_only=True))
    return model.eval()


def _onnxruntime() -> None:
    """Skip (fail under CI) where the onnx extra is not installed."""
    for name in ("onnx", "onnxscript", "onnxruntime"):
        if importlib.util.find_spec(name) is None:
            unavailable(f"{name} is not installed ({ONNX_HINT}; make installs it)")


def test_the_pt2_and_the_onnx_compute_the_models_logits(
    trained: tuple[Recipe, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The manual's loading code, run on an export: model.pt2 (torch.export.load) and
    model.onnx (onnxruntime) give the state dict's logits, for another batch size than the one
    they were exported with."""
    _onnxruntime()
    recipe, best = trained
    out = tmp_path / "runs" / "a" / "export"
    assert main(["export", str(best), "--out", str(out)]) == 0
    info = json.loads((out / "export.json").read_text())
    assert info["written"] == ["state_dict.pt", "model.pt2", "model.onnx"], info["not_written"]
    assert info["num_classes"] == 10 and info["input"] == [3, 32, 32]
    assert "wrote state_dict.pt, model.pt2, model.onnx" in capsys.readouterr().out
    (code,) = [c for text in pages().values() for m, c in python_blocks(text) if m.startswith("export-load")]
    monkeypatch.chdir(tmp_path)
    scope: dict[str, Any] = {}
    with torch.no_grad():
        exec(compile(code, "docs/eval-predict-export.md", "exec"), scope)
        expected = _exported_model(recipe, out)(scope["images"])
    assert scope["images"].shape[0] == 4 and torch.allclose(scope["logits"], expected, atol=1e-5)
    assert torch.allclose(torch.from_numpy(scope["onnx_logits"]), expected, atol=1e-4)


def test_without_onnx_the_export_says_what_to_install(
    trained: tuple[Recipe, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Without onnxscript the ONNX step is skipped with one line naming the extra; asked for
    by name (--format onnx), it is an error naming it."""
    _, best = trained
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # an import of it fails, as when missing
    assert main(["export", str(best), "--out", str(tmp_path / "a")]) == 0
    lines = capsys.readouterr().out.splitlines()
    skipped = [line for line in lines if "model.onnx" in line]
    assert len(skipped) == 1 and "onnxscript" in skipped[0] and ONNX_HINT in skipped[0], lines
    assert (tmp_path / "a" / "model.pt2").exists() and not (tmp_path / "a" / "model.onnx").exists()
    assert main(["export", str(best), "--out", str(tmp_path / "b"), "--format", "onnx"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and "onnxscript" in errors[0] and ONNX_HINT in errors[0], errors


def test_fine_tune_from_the_exported_weights(trained: tuple[Recipe, Path], tmp_path: Path) -> None:
    """`model.init_from` starts a 12-class run from the 10-class run's exported state dict."""
    recipe, best = trained
    out = tmp_path / "export"
    assert main(["export", str(best), "--out", str(out), "--format", "pt2"]) == 0
    assert json.loads((out / "export.json").read_text())["written"] == ["state_dict.pt", "model.pt2"]
    tuned = small_recipe(
        Path(recipe.data.root),
        model={"name": "small_cnn", "num_classes": 12, "init_from": str(out / "state_dict.pt")},
    )
    with pytest.warns(UserWarning, match="head.3.bias, head.3.weight differ in shape"):
        summary = train(tuned, tmp_path / "tuned", progress=False)
    assert summary["optimizer_steps"] == 7
