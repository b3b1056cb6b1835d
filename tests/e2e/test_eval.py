"""Exact distributed validation: `stallfree eval` gives the same figures on 1 and 2 ranks."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import astuple
from pathlib import Path

import pytest
from helpers import PYTHON, small_recipe
from inprocess import Cli

from stallfree.recipe import dump_toml
from stallfree.train.run import train

pytestmark = pytest.mark.e2e  # every test here trains a run or starts a process


def _eval_on_ranks(recipe_path: Path, checkpoint: Path, ranks: int, backend: str) -> dict:
    """`stallfree eval --json` under torchrun, `ranks` processes: a subject only processes have."""
    launcher = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--standalone"]
    result = subprocess.run(
        [
            *launcher,
            "-m",
            "stallfree",
            "eval",
            str(recipe_path),
            "--checkpoint",
            str(checkpoint),
            "--loader",
            backend,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def trained(image_root: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One short run shared by this module's tests: (its recipe file, its run directory).
    29 val images (one left out): neither 2 ranks nor batch 8 divides it."""
    tmp = tmp_path_factory.mktemp("eval")
    files = sorted(p for p in image_root.glob("*/*/*.jpg"))
    keep = [str(p.relative_to(image_root)) for p in files if p.name != files[-1].name or "train" in p.parts]
    clean = tmp / "list.txt"
    clean.write_text("\n".join(keep) + "\n")
    recipe = small_recipe(image_root, data={"file_list": str(clean)}, train={"batch_size": 16, "epochs": 1})
    train(recipe, tmp / "run", progress=False)
    recipe_path = tmp / "r.toml"
    recipe_path.write_text(dump_toml(recipe))
    return recipe_path, tmp / "run"


def _eval_here(recipe_path: Path, checkpoint: Path, backend: str, cli: Cli) -> dict:
    """`stallfree eval --json` in this process (one rank): no second torch start-up."""
    done = cli("eval", recipe_path, "--checkpoint", checkpoint, "--loader", backend, "--json")
    assert done.code == 0, done.err[-3000:]
    return json.loads(done.out.strip().splitlines()[-1])


@pytest.mark.parametrize("backend", ["torch", pytest.param("dali", marks=pytest.mark.dali)])
def test_val_on_two_ranks_equals_one_rank_to_the_last_sample(
    trained: tuple[Path, Path], backend: str, cli: Cli
) -> None:
    recipe_path, run = trained
    checkpoint = sorted((run / "checkpoints").glob("ckpt-*.pt"))[-1]
    one = _eval_here(recipe_path, checkpoint, backend, cli)
    two = _eval_on_ranks(recipe_path, checkpoint, 2, backend)
    assert one["samples"] == two["samples"] == 29
    assert (one["val_top1"], one["val_top5"]) == (two["val_top1"], two["val_top5"])
    assert two["world_size"] == 2


def test_sync_bn_converts_under_ddp_and_refuses_the_cpu() -> None:
    import torch
    from torch import nn

    from stallfree.errors import StallfreeError
    from stallfree.models import build_model
    from stallfree.parallel import DistInfo
    from stallfree.train.assemble import sync_batchnorm

    recipe = small_recipe("", train={"sync_bn": True})
    model = build_model(recipe.model, 10)
    assert sync_batchnorm(model, recipe, DistInfo(), torch.device("cpu")) is model  # one rank
    two = DistInfo(rank=0, world_size=2)
    with pytest.raises(StallfreeError, match="sync_bn = true needs CUDA"):
        sync_batchnorm(model, recipe, two, torch.device("cpu"))
    synced = sync_batchnorm(model, recipe, two, torch.device("cuda", 0))  # converts, on any host
    assert any(isinstance(m, nn.SyncBatchNorm) for m in synced.modules())


def test_eval_json_carries_the_val_loss_training_logged(trained: tuple[Path, Path], cli: Cli) -> None:
    path, run = trained
    result = _eval_here(path, run, "torch", cli)
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    logged = [r for r in records if "val_loss" in r][-1]  # the same weights, after the last epoch
    assert result["val_loss"] == pytest.approx(logged["val_loss"], rel=1e-5)
    assert result["val_top1"] == logged["val_top1"]


def test_eval_without_a_recipe_uses_the_checkpoints_own(trained: tuple[Path, Path], cli: Cli) -> None:
    """The recipe is optional: the checkpoint's own (its data, file list, sizes) is the default."""
    _, run = trained
    code, out, _ = astuple(cli("eval", "--checkpoint", run, "--json"))
    assert code == 0
    result = json.loads(out.strip().splitlines()[-1])
    logged = [json.loads(line) for line in (run / "metrics.jsonl").open() if "val_loss" in line][-1]
    assert result["samples"] == 29  # the training recipe's file list
    assert result["val_loss"] == pytest.approx(logged["val_loss"], rel=1e-5)


def _copy_classes(image_root: Path, into: Path, classes: list[str], rename: str = "") -> Path:
    for split in ("train", "val"):
        for name in classes:
            shutil.copytree(image_root / split / name, into / split / f"{rename}{name}")
    return into


def _recipe_file(path: Path, root: Path, **augment: int) -> Path:
    sizes = {"image_size": 32, "resize_size": 36, **augment}
    path.write_text(dump_toml(small_recipe(root, train={"batch_size": 16}, augment=sizes)))
    return path


def test_eval_holds_a_given_recipe_to_the_checkpoint(
    trained: tuple[Path, Path], image_root: Path, tmp_path: Path, cli: Cli
) -> None:
    """Another class count, the same count under other names, another val size: one line that
    names both values, never a traceback or a silently wrong figure. Another val set of the
    same classes is legitimate: evaluated, with a warning naming both roots."""
    _, run = trained
    classes = sorted(p.name for p in (image_root / "train").iterdir())
    cases = {
        "three": (_copy_classes(image_root, tmp_path / "three", classes[:3]), {}, ["3", "10"]),
        "renamed": (
            _copy_classes(image_root, tmp_path / "renamed", classes, rename="x"),
            {},
            [f"x{classes[0]}", classes[0]],
        ),
        "48px": (image_root, {"image_size": 48, "resize_size": 55}, ["48", "32"]),
    }
    for name, (root, sizes, named) in cases.items():
        recipe = _recipe_file(tmp_path / f"{name}.toml", root, **sizes)
        code, out, err = astuple(cli("eval", recipe, "--checkpoint", run))
        lines = [line for line in err.splitlines() if "error" in line]
        assert code == 2 and not out and len(lines) == 1, (name, err)
        assert all(value in lines[0] for value in named) and str(recipe) in lines[0], (name, err)

    other = _copy_classes(image_root, tmp_path / "other", classes)
    code, out, err = astuple(cli("eval", _recipe_file(tmp_path / "o.toml", other), "--checkpoint", run))
    assert code == 0 and "top-1" in out
    assert str(other) in err and str(image_root) in err
