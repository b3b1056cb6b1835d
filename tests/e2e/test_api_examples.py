"""The README's plain loop (and its copy in the manual) and examples/lightning_datamodule.py run
as written, on both loaders, and see the samples `stallfree train` sees with the same recipe, in
the same order; under torchrun each rank's share is the CLI's."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from doc_pages import pages, python_blocks
from helpers import PYTHON
from test_api import BACKENDS, _cli_batches, _recipe_file

import stallfree
from stallfree.parallel import DistInfo
from stallfree.recipe import apply_overrides, load_recipe

pytestmark = pytest.mark.e2e  # every test here trains a run or starts a process

REPO = Path(__file__).resolve().parents[2]


def _small(root: Path, backend: str) -> list[str]:
    """The demo recipe shrunk to the test data and a fast CPU pass."""
    return [
        f'data.root="{root}"',
        "augment.image_size=32",
        "augment.resize_size=36",
        "train.batch_size=8",
        f'loader.backend="{backend}"',
        "loader.torch.workers=0",
    ]


def _cli_labels(overrides: list[str], split: str, epoch: int) -> list[list[int]]:
    recipe = apply_overrides(load_recipe(REPO / "pipelines/demo.toml"), overrides)
    return [labels.tolist() for _, labels in _cli_batches(recipe, split, DistInfo(), epoch)]


class Recorded:
    """A loader that records the labels of each pass (one list per `iter`)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.passes = inner, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def __enter__(self) -> Recorded:
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.close()

    def __iter__(self) -> Iterator[Any]:
        seen: list[list[int]] = []
        self.passes.append(seen)
        for batch in self.inner:
            seen.append(batch.labels.tolist())
            yield batch


@pytest.mark.parametrize("backend", BACKENDS)
def test_readme_plain_loop_sees_the_clis_order(
    image_root: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's loop, run as written from the repository root, with the recipe pointed at
    the test data: its two epochs are the CLI's two epochs, batch by batch. A manual page that
    shows the loop shows the same text, so this one run covers every copy."""
    copies = {
        code
        for text in pages().values()
        for marker, code in python_blocks(text)
        if marker.startswith("plain-loop")
    }
    assert len(copies) == 1, "the pages show the plain loop in different words"
    (code,) = copies
    small, made = _small(image_root, backend), []
    real = stallfree.loader

    def recorded(recipe: str, split: str = "train", **kwargs: Any) -> Recorded:
        made.append(
            Recorded(real(recipe, split, **{**kwargs, "overrides": [*kwargs.get("overrides", ()), *small]}))
        )
        return made[-1]

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(stallfree, "loader", recorded)
    scope: dict[str, Any] = {}
    exec(compile(code, "README.md", "exec"), scope)
    (loader,) = made
    assert loader.passes == [_cli_labels(small, "train", 0), _cli_labels(small, "train", 1)]
    # Saved after epoch 1's last batch: it resumes at epoch 2's start, not by replaying epoch 1.
    assert (scope["state"]["epoch"], scope["state"]["position"]) == (2, 0)


def _lightning() -> ModuleType:
    """The example module; a skip with the reason where lightning is missing (a failure under CI)."""
    if importlib.util.find_spec("lightning") is None:
        if os.environ.get("CI"):
            pytest.fail("lightning is not installed under CI; pip install -e '.[lightning]'")
        pytest.skip("lightning is not installed (pip install -e '.[lightning]')")
    spec = importlib.util.spec_from_file_location(
        "lightning_datamodule", REPO / "examples/lightning_datamodule.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trainer(lightning: Any, **kwargs: Any) -> Any:
    settings = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "use_distributed_sampler": False,
    }
    return lightning.Trainer(**{**settings, **kwargs})


@pytest.mark.parametrize("backend", BACKENDS)
def test_lightning_datamodule_sees_the_clis_order_and_resumes_mid_epoch(
    image_root: Path, tmp_path: Path, backend: str
) -> None:
    """3 steps, Lightning's checkpoint, a fresh Trainer and DataModule resume from it: the
    batches trained on over both fits are the CLI's two epochs, none repeated or skipped,
    and validation reads the CLI's val batches."""
    example = _lightning()
    import lightning

    class Recording(example.TinyClassifier):
        def __init__(self) -> None:
            super().__init__(num_classes=10)
            self.seen: dict[str, list[list[int]]] = {"train": [], "val": []}

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.seen["train"].append(batch[1].tolist())
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.seen["val"].append(batch[1].tolist())
            super().validation_step(batch, batch_idx)

    small = _small(image_root, backend)
    recipe = str(REPO / "pipelines/demo.toml")
    first = Recording()
    # Saved by Lightning inside step 3 (on_train_batch_end), while batch 4 is already fetched.
    saver = lightning.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path, filename="mid", every_n_train_steps=3, save_top_k=-1
    )
    _trainer(lightning, max_steps=5, enable_checkpointing=True, callbacks=[saver]).fit(
        first, datamodule=example.StallfreeDataModule(recipe, small)
    )
    second = Recording()
    _trainer(lightning, max_epochs=2).fit(
        second, datamodule=example.StallfreeDataModule(recipe, small), ckpt_path=tmp_path / "mid.ckpt"
    )
    epochs = _cli_labels(small, "train", 0) + _cli_labels(small, "train", 1)
    assert first.seen["train"] == epochs[:5]
    assert second.seen["train"] == epochs[3:]
    assert second.seen["val"] == 2 * _cli_labels(small, "val", 0)


@pytest.mark.slow  # torchrun: three Python starts with torch (~16 s on 2 cores)
def test_two_ranks_under_torchrun_get_the_clis_shares(image_root: Path, tmp_path: Path) -> None:
    """torchrun, 2 processes, gloo: ranks from the process group; each rank's batches of
    epoch 1 are the CLI's for that rank, on both loaders."""
    backends = ["torch"] + (["dali"] if importlib.util.find_spec("nvidia.dali") else [])
    path = _recipe_file(image_root, tmp_path)
    done = subprocess.run(
        [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone"]
        + [str(Path(__file__).parents[1] / "api_ranks.py"), str(path), str(tmp_path), *backends],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for backend in backends:
        recipe = load_recipe(path)
        recipe.loader.backend = backend
        for rank in (0, 1):
            got = json.loads((tmp_path / f"rank{rank}.json").read_text())[backend]
            cli = _cli_batches(recipe.copy(), "train", DistInfo(rank=rank, world_size=2), 1)
            assert got == [labels.tolist() for _, labels in cli], (backend, rank)
            assert len(got) == 60 // (8 * 2)


@pytest.mark.e2e  # a Lightning fit: one short epoch on the CPU
def test_lightning_example_writes_its_logs_under_runs_with_the_datas_classes(
    image_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run as the README says, from a checkout: Lightning's logs and checkpoints land in the
    run folder (runs/ is ignored by git), never in a lightning_logs/ beside the sources; on
    3-class data the model has 3 outputs, the data's count (model.num_classes wins when set)."""
    example = _lightning()
    three = tmp_path / "data"
    for name in sorted(os.listdir(image_root / "train"))[:3]:
        for split in ("train", "val"):
            shutil.copytree(image_root / split / name, three / split / name)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    small = [*_small(three, "torch"), "train.epochs=1"]
    example.main([str(REPO / "pipelines/demo.toml"), *(arg for item in small for arg in ("--set", item))])
    assert sorted(os.listdir(work)) == ["runs"]
    (ckpt,) = (work / "runs").rglob("*.ckpt")
    assert torch.load(ckpt, weights_only=False)["state_dict"]["net.4.weight"].shape == (3, 16)
    recipe = str(REPO / "pipelines/demo.toml")
    assert example.StallfreeDataModule(recipe, [*small, "model.num_classes=5"]).num_classes == 5
