"""EMA, mixup/cutmix and torch.compile: exact, seeded and resumable."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import small_recipe
from torch import nn

from stallfree.train.checkpoint import load_checkpoint
from stallfree.train.ema import ModelEma
from stallfree.train.mix import Mixer
from stallfree.train.run import train

pytestmark = pytest.mark.e2e  # every test here trains a run or starts a process


def test_ema_follows_the_warmed_up_decay() -> None:
    model = nn.Linear(2, 1, bias=False)
    nn.init.zeros_(model.weight)
    ema = ModelEma(model, decay=0.99)
    expected = torch.zeros(1, 2)
    for step in range(5):
        with torch.no_grad():
            model.weight.add_(1.0)
        decay = min(0.99, (1 + step) / (10 + step))
        expected = decay * expected + (1 - decay) * model.weight.detach()
        ema.update(model)
    assert torch.allclose(ema.module.weight, expected)


def test_mixer_is_seeded_and_cutmix_lambda_is_the_kept_area() -> None:
    images = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).reshape(2, 3, 8, 8)
    labels = torch.tensor([0, 1])
    mixer = Mixer(mixup_alpha=0.0, cutmix_alpha=1.0, prob=1.0, seed=3, rank=0)
    first = mixer(images, labels, epoch=1, index=4)
    again = mixer(images, labels, epoch=1, index=4)
    assert torch.equal(first.images, again.images) and first.lam == again.lam
    changed = (first.images != images).any(dim=1)  # pixels taken from the partner
    assert first.partner_labels.ne(labels).all()  # seed 3 pairs the two images
    assert changed.float().mean().item() == pytest.approx(1 - first.lam)
    assert 0 < first.lam < 1
    assert (
        Mixer(mixup_alpha=0.2, cutmix_alpha=0.0, prob=0.0, seed=3, rank=0)(images, labels, epoch=0, index=0)
        is None
    )


def _recipe(root: Path, backend: str = "torch"):
    # 60 images / batch 8 = 7 batches; accum 2 -> 4 optimizer steps an epoch.
    return small_recipe(
        root,
        augment={
            "image_size": 32,
            "resize_size": 36,
            "mixup_alpha": 0.2,
            "cutmix_alpha": 1.0,
            "mix_prob": 0.8,
        },
        train={
            "epochs": 2,
            "accum_steps": 2,
            "ckpt_every_steps": 1,
            "keep_checkpoints": 20,
            "ema_decay": 0.9,
        },
        loader={"backend": backend},
        optim={"name": "sgd", "lr": 0.05},
    )


@pytest.mark.parametrize("backend", ["torch", pytest.param("dali", marks=pytest.mark.dali)])
def test_ema_and_mixing_resume_bitwise(image_root: Path, tmp_path: Path, backend: str) -> None:
    recipe = _recipe(image_root, backend)
    full = tmp_path / "full"
    train(recipe, full, progress=False)
    final = load_checkpoint(full / "checkpoints" / "ckpt-000000008.pt")
    run = tmp_path / "resumed"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(full / "checkpoints" / "ckpt-000000005.pt", run / "checkpoints")  # mid-epoch 1
    train(recipe, run, progress=False, resume="auto")
    resumed = load_checkpoint(run / "checkpoints" / "ckpt-000000008.pt")
    for key in ("model",):
        for name, tensor in final[key].items():
            assert torch.equal(tensor, resumed[key][name]), name
    for name, tensor in final["ema"]["module"].items():
        assert torch.equal(tensor, resumed["ema"]["module"][name]), name
    records = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if "val_top1" in r]
    assert len(val) == 2 and all(0 <= r["val_top1_ema"] <= 1 for r in val)
    # The EMA differs from the raw weights: it really is an average.
    first = next(iter(final["model"]))
    assert not torch.equal(final["model"][first], final["ema"]["module"][first])


def test_compile_trains_a_step(image_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Dynamo traces the trainer's model and AOTAutograd builds its backward, as with inductor;
    # inductor's C++ code generation (torch's own, ~50 s on 2 cores with a cold cache) is skipped.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    recipe = small_recipe(image_root, train={"compile": True, "batch_size": 30, "epochs": 1})
    summary = train(recipe, tmp_path / "run", progress=False)
    assert summary["optimizer_steps"] == 2
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "ckpt-000000002.pt")
    assert not any(name.startswith("_orig_mod") for name in state["model"])  # plain weights
