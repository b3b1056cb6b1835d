"""Exact distributed validation: `stallfree eval` gives the same figures on 1 and 2 ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import small_recipe

from stallfree.recipe import dump_toml
from stallfree.train.run import train


def _eval(recipe_path: Path, checkpoint: Path, ranks: int, backend: str) -> dict:
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--standalone"]
        if ranks > 1
        else [sys.executable]
    )
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


@pytest.mark.parametrize("backend", ["torch", pytest.param("dali", marks=pytest.mark.dali)])
def test_val_on_two_ranks_equals_one_rank_to_the_last_sample(
    image_root: Path, tmp_path: Path, backend: str
) -> None:
    # 29 val images (one left out): neither 2 ranks nor batch 8 divides it.
    files = sorted(p for p in image_root.glob("*/*/*.jpg"))
    keep = [str(p.relative_to(image_root)) for p in files if p.name != files[-1].name or "train" in p.parts]
    clean = tmp_path / "list.txt"
    clean.write_text("\n".join(keep) + "\n")
    recipe = small_recipe(image_root, data={"file_list": str(clean)}, train={"batch_size": 16, "epochs": 1})
    train(recipe, tmp_path / "run", progress=False)
    recipe_path = tmp_path / "r.toml"
    recipe_path.write_text(dump_toml(recipe))
    checkpoint = sorted((tmp_path / "run" / "checkpoints").glob("ckpt-*.pt"))[-1]
    one = _eval(recipe_path, checkpoint, 1, backend)
    two = _eval(recipe_path, checkpoint, 2, backend)
    assert one["samples"] == two["samples"] == 29
    assert (one["val_top1"], one["val_top5"]) == (two["val_top1"], two["val_top5"])
    assert two["world_size"] == 2


def test_sync_bn_converts_under_ddp_and_refuses_the_cpu() -> None:
    import torch
    from torch import nn

    from stallfree.errors import StallfreeError
    from stallfree.models import build_model
    from stallfree.parallel import DistInfo
    from stallfree.train.build import sync_batchnorm

    recipe = small_recipe("", train={"sync_bn": True})
    model = build_model(recipe.model, 10)
    assert sync_batchnorm(model, recipe, DistInfo(), torch.device("cpu")) is model  # one rank
    two = DistInfo(rank=0, world_size=2)
    with pytest.raises(StallfreeError, match="sync_bn = true needs CUDA"):
        sync_batchnorm(model, recipe, two, torch.device("cpu"))
    synced = sync_batchnorm(model, recipe, two, torch.device("cuda", 0))  # converts, on any host
    assert any(isinstance(m, nn.SyncBatchNorm) for m in synced.modules())


def test_eval_json_carries_the_val_loss_training_logged(
    image_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from stallfree.cli import main

    recipe = small_recipe(image_root, train={"batch_size": 16})
    train(recipe, tmp_path / "run", progress=False)
    path = tmp_path / "r.toml"
    path.write_text(dump_toml(recipe))
    capsys.readouterr()
    assert main(["eval", str(path), "--checkpoint", str(tmp_path / "run"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    logged = [r for r in records if "val_loss" in r][-1]  # the same weights, after the last epoch
    assert result["val_loss"] == pytest.approx(logged["val_loss"], rel=1e-5)
    assert result["val_top1"] == logged["val_top1"]
