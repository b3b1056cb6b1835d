"""End to end: recipe -> loader -> trainer -> run directory, through the CLI too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import small_recipe
from stallfree.cli import main
from stallfree.data.demo import write_demo
from stallfree.recipe import dump_toml, load_recipe
from stallfree.train.run import train


@pytest.fixture(scope="module")
def learnable_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo(tmp_path_factory.mktemp("learn"), train_per_class=40, val_per_class=10,
                      seed=3, progress=False)


def test_short_demo_run_beats_chance(learnable_root: Path, tmp_path: Path) -> None:
    recipe = small_recipe(
        learnable_root,
        augment={"image_size": 32, "resize_size": 36, "scale": [0.35, 1.0]},
        optim={"lr": 0.005, "weight_decay": 0.05, "warmup_steps": 10, "label_smoothing": 0.1},
        train={"epochs": 14, "batch_size": 32, "precision": "bf16", "log_every": 5},
        loader={"torch": {"workers": 2}},
    )
    summary = train(recipe, tmp_path / "run", progress=False)
    # 10 classes: chance is 0.10; this run measured 0.37.
    assert summary["val_top1"] >= 0.25, summary
    run = tmp_path / "run"
    assert load_recipe(run / "recipe.toml") == recipe
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "loss" in r]
    val_records = [r for r in records if "val_top1" in r]
    assert len(val_records) == 14
    assert train_records[-1]["loss"] < train_records[0]["loss"]
    for key in ("step", "epoch", "loss", "lr", "images_per_s", "data_wait_frac"):
        assert key in train_records[0]
    saved = json.loads((run / "summary.json").read_text())
    for key in ("images_per_s", "data_wait_frac", "val_top1", "wall_s"):
        assert isinstance(saved[key], float)


def test_cli_train_with_overrides_and_compare(image_root: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    recipe_path = tmp_path / "r.toml"
    recipe_path.write_text(dump_toml(small_recipe(image_root)))
    out = tmp_path / "run"
    code = main(["train", str(recipe_path), "--loader", "synthetic", "--device", "cpu",
                 "--epochs", "2", "--out", str(out), "--set", "train.batch_size=4", "--no-progress"])
    assert code == 0
    saved = load_recipe(out / "recipe.toml")
    assert saved.loader.backend == "synthetic" and saved.train.epochs == 2
    assert saved.train.batch_size == 4
    assert main(["compare", str(out)]) == 0
    assert "synthetic" in capsys.readouterr().out


def test_cli_errors_name_the_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe_path = tmp_path / "r.toml"
    recipe_path.write_text('[data]\nroot = "/nonexistent/demo"\n')
    assert main(["train", str(recipe_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "data.root /nonexistent/demo does not exist" in err and "stallfree data demo" in err
    assert main(["train", str(recipe_path), "--set", "train.epoch=2"]) == 2
    assert "unknown key 'train.epoch'" in capsys.readouterr().err


def test_python_dash_m_entry_point() -> None:
    result = subprocess.run([sys.executable, "-m", "stallfree", "--help"], capture_output=True,
                            text=True, check=True)
    assert "train" in result.stdout and "data" in result.stdout


def test_torchrun_two_cpu_ranks(image_root: Path, tmp_path: Path) -> None:
    """DDP over gloo: both ranks step together (no_sync windows, gathered checkpoints)."""
    recipe = small_recipe(image_root, train={"epochs": 2, "accum_steps": 2, "ckpt_every_steps": 1})
    recipe_path = tmp_path / "r.toml"
    recipe_path.write_text(dump_toml(recipe))
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--standalone", "-m", "stallfree", "train", str(recipe_path), "--out", str(out),
         "--no-progress"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    # 60 images / 2 ranks / batch 8 = 3 batches a rank; accum 2 -> 2 steps an epoch.
    assert summary["world_size"] == 2 and summary["optimizer_steps"] == 4
    assert summary["global_batch"] == 32
    from stallfree.train.checkpoint import load_checkpoint

    state = load_checkpoint(out / "checkpoints" / "ckpt-000000004.pt")
    assert len(state["ranks"]) == 2 and state["world_size"] == 2
