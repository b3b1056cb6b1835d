"""--loader auto (the fallback chain), workers/threads = "auto", and synthetic-decode."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from helpers import build_loader, small_recipe

import stallfree.data.choose as auto
from stallfree.parallel import DistInfo
from stallfree.train.prepare import prepare_recipe

CPU = torch.device("cpu")
GPU = torch.device("cuda", 0)  # a device object only: nothing runs on it


@pytest.fixture
def fake_machine(monkeypatch: pytest.MonkeyPatch):
    """Set what the chain sees: DALI's import problem, the GPU probe's, the cores per rank."""

    def setup(dali: str | None, gpu: str | None, cores: int) -> None:
        monkeypatch.setattr(auto, "_dali_problem", lambda: dali)
        monkeypatch.setattr(auto, "_gpu_decode_problem", lambda index: gpu)
        monkeypatch.setattr(auto, "cpu_workers", lambda requested, ranks: cores)

    return setup


@pytest.mark.parametrize(
    "dali, gpu, cores, expected",
    [
        (None, None, 2, ("dali", "auto")),  # nvJPEG works
        (None, "nvjpeg did not load", 8, ("dali", "cpu")),
        (None, "nvjpeg did not load", 2, ("torch", "auto")),  # too few cores for DALI's CPU decode
        ("DALI does not import", None, 8, ("torch", "auto")),
    ],
)
def test_the_fallback_chain_on_a_gpu(fake_machine, dali, gpu, cores, expected) -> None:
    fake_machine(dali, gpu, cores)
    choice = auto.choose_backend(GPU)
    assert (choice.backend, choice.dali_decode) == expected
    why = choice.why
    assert why and (gpu is None or gpu in why or dali in why)


def test_auto_on_a_cpu_run_is_resolved_once_and_said(
    image_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    recipe = small_recipe(image_root, loader={"backend": "auto"})
    with caplog.at_level(logging.INFO, logger="stallfree"):
        ctx = prepare_recipe(recipe, DistInfo())
    assert ctx.resolved.backend == ctx.backend.name == auto.CPU_CHOICE
    assert ctx.recipe.loader.backend == "auto"  # the recipe as given; the record says the choice
    assert f"--loader auto: {auto.CPU_CHOICE} (CPU run" in caplog.text
    loader = ctx.with_dataset().loader("val")
    assert len(list(loader)) == len(loader) == 4
    loader.close()


@pytest.mark.parametrize("backend", ["torch", pytest.param("dali", marks=pytest.mark.dali)])
def test_synthetic_decode_runs_the_real_pipeline_on_copies_in_memory(image_root: Path, backend: str) -> None:
    """With fewer files than it holds, synthetic-decode's val epoch is the real one, pixel
    for pixel; the copies are in RAM and gone after close()."""
    recipe = small_recipe(image_root, loader={"backend": "synthetic-decode", "synthetic_decode": backend})
    loader = build_loader(recipe, "val", device=CPU)
    folder = loader.folder
    assert folder.startswith("/dev/shm/") or not os.path.isdir("/dev/shm")
    assert len(os.listdir(folder)) == 30
    fake = list(loader)
    loader.close()
    assert not os.path.exists(folder)
    recipe.loader.backend = backend
    real_loader = build_loader(recipe, "val", device=CPU)
    real = list(real_loader)
    real_loader.close()
    assert len(fake) == len(real)
    for a, b in zip(fake, real):
        assert torch.equal(a.labels, b.labels) and torch.equal(a.images, b.images)


def test_synthetic_decode_names_the_users_file(tmp_path: Path) -> None:
    from test_loaders import _bomb_jpeg, _root_with_one_bad_file

    from stallfree.data.readers.imageio import BadImageError

    bad = _root_with_one_bad_file(tmp_path, "3.jpg", _bomb_jpeg(), "train")
    recipe = small_recipe(tmp_path, loader={"backend": "synthetic-decode"})
    with pytest.raises(BadImageError) as info:
        build_loader(recipe, "train", device=CPU)
    assert info.value.path == str(bad)
