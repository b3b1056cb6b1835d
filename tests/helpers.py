"""Test helpers: an in-memory Loader for trainer tests and small recipe builders."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from stallfree.data.loader import Batch, Loader, ShardedLoader
from stallfree.data.readers.folders import Dataset
from stallfree.parallel import DistInfo
from stallfree.recipe import Recipe, dump_toml, recipe_from_dict

# The `python` of the end-to-end runs: the session's fork server, with torch imported already
# (zygote.py); the real interpreter where a test is about a fresh one (its imports, its exit).
PYTHON = str(Path(__file__).resolve().parent / "fastpython")
# Fragments of obstore's own words (its error types' text, the HTTP client's, the credential
# providers'): a store's error says what happened in ours, the client's goes to --verbose.
CLIENT_WORDS = re.compile(
    r"Generic |Error performing|HTTP error|error sending request|AwsLc|InvalidEncoding|"
    r"resolve_deny|Debug source|Invalid Access Key"
)


class TensorLoader(ShardedLoader):
    """Fixed micro-batches of in-memory tensors, in order, through the real sharded base."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, batch_size: int) -> None:
        super().__init__(len(images), batch_size=batch_size, dist=DistInfo(), train=False, seed=0)
        self.images, self.labels = images, labels

    def __iter__(self) -> Iterator[Batch]:
        return self._counted(
            Batch(self.images[ids], self.labels[ids]) for ids in map(torch.from_numpy, self.remaining_ids())
        )


def one_step_trainer(path: Path, image_root: Path, overrides: list[str]) -> tuple[Any, Any, Any]:
    """(run context, train loader, trainer) of the recipe at `path` shrunk to a CPU step on
    `image_root`: batch 4, fp32, torch loader in the main process, plus `overrides`."""
    import warnings

    from stallfree.recipe import apply_overrides, load_recipe
    from stallfree.train.assemble import build_trainer
    from stallfree.train.prepare import prepare

    recipe = apply_overrides(
        load_recipe(path),
        [
            f'data.root="{image_root}"',
            "train.batch_size=4",
            'train.device="cpu"',
            'train.precision="fp32"',
            'loader.backend="torch"',
            "loader.torch.workers=0",
            *overrides,
        ],
    )
    ctx = prepare(recipe)
    loader = ctx.loader("train")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # warmup longer than this tiny run: expected here
        trainer = build_trainer(ctx, train_batches=len(loader), progress=False)
    return ctx, loader, trainer


def build_loader(
    recipe: Recipe,
    split: str,
    *,
    device: torch.device,
    dist: DistInfo | None = None,
    dataset: Dataset | None = None,
) -> Loader:
    """One loader of `split`, its backend resolved as a run resolves it ("auto" decided on
    `device`, the dataset listed unless given, "auto" counts measured), without the recipe's
    cross-key checks: tests build loaders from recipes a run would refuse (a val crop too big)."""
    import dataclasses

    from stallfree.train.prepare import prepare_recipe

    ctx = dataclasses.replace(prepare_recipe(recipe, dist or DistInfo(), device), dataset=dataset)
    return ctx.with_dataset().with_loader_counts().loader(split)


def small_recipe(root: Path | str, **sections: dict[str, Any]) -> Recipe:
    """A fast CPU recipe over `root`; `sections` override tables key by key."""
    raw: dict[str, dict[str, Any]] = {
        "data": {"root": str(root)},
        "augment": {"image_size": 32, "resize_size": 36},
        "model": {"name": "small_cnn"},
        "optim": {"name": "adamw", "lr": 0.003, "weight_decay": 0.0},
        "train": {"epochs": 1, "batch_size": 8, "precision": "fp32", "log_every": 1, "device": "cpu"},
        "loader": {"backend": "torch", "torch": {"workers": 0}},
    }
    for name, table in sections.items():
        _merge(raw.setdefault(name, {}), table)
    return recipe_from_dict(raw)


def _merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def train_until_logged(
    recipe: Recipe, tmp_path: Path, records: int, extra: tuple[str, ...] = (), new_session: bool = False
) -> tuple[subprocess.Popen, list[str], Path]:
    """Start `stallfree train` on `recipe` in a subprocess; return once metrics.jsonl holds
    `records` lines (the run is stepping): (process, its command, its run directory)."""
    recipe_path = tmp_path / "r.toml"
    recipe_path.write_text(dump_toml(recipe))
    run = tmp_path / "run"
    cmd = [
        PYTHON,
        "-m",
        "stallfree",
        "train",
        str(recipe_path),
        "--out",
        str(run),
        "--no-progress",
        *extra,
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=new_session
    )  # its own group, to signal it all
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= records:
            break
        time.sleep(0.05)
    return proc, cmd, run


class Collect:
    """A metrics sink that keeps the records in memory."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def close(self) -> None:
        pass


def jpeg_with_segments(
    path: Path, segments: list[tuple[int, bytes]], size: tuple[int, int] = (64, 48)
) -> Path:
    """A JPEG of a horizontal ramp with the given (marker, payload) header segments right after
    SOI, in order (e.g. two EXIF APP1 blocks, or an EXIF block inside a comment)."""
    import io

    import numpy as np
    from PIL import Image

    ramp = np.broadcast_to(
        (np.arange(size[0]) * 255 // max(1, size[0] - 1)).astype(np.uint8), (size[1], size[0])
    )
    encoded = io.BytesIO()
    Image.fromarray(np.stack([ramp, ramp[::-1], ramp // 2], -1)).save(encoded, "JPEG", quality=95)
    data = encoded.getvalue()
    head = b"".join(
        bytes([0xFF, marker]) + (len(body) + 2).to_bytes(2, "big") + body for marker, body in segments
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data[:2] + head + data[2:])
    return path


def exif_block(orientation: int) -> bytes:
    """An APP1 EXIF payload ("Exif\\0\\0" + TIFF header) holding only `orientation`."""
    from PIL import Image

    exif = Image.Exif()
    exif[0x0112] = orientation
    raw = exif.tobytes()
    return raw if raw.startswith(b"Exif\x00\x00") else b"Exif\x00\x00" + raw


def torchrun_train(*args: str) -> list[str]:
    """`torchrun --nproc_per_node 2 --standalone -m stallfree train ARGS --no-progress`: two CPU
    ranks on this machine (gloo), as the DDP tests launch them."""
    return [
        PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
        "-m", "stallfree", "train", *args, "--no-progress",
    ]  # fmt: skip


def stop_after(steps: int) -> type:
    """A StopSignal whose flag reads SIGTERM from the trainer's `steps`-th check on (it checks
    once after every optimizer step): a stop as a scheduler sends it, at a known step. Patch it
    over `stallfree.train.run.StopSignal`."""
    from stallfree.train.signals import StopSignal

    class StopAfter(StopSignal):
        checks = 0

        @property
        def requested(self) -> str | None:  # type: ignore[override]
            type(self).checks += 1
            return "SIGTERM" if type(self).checks >= steps else None

        @requested.setter
        def requested(self, value: str | None) -> None:
            pass

    return StopAfter


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    """The model weights of the run's newest checkpoint (what runs compared bitwise end with)."""
    from stallfree.train.checkpoint import load_checkpoint

    return load_checkpoint(sorted((run / "checkpoints").glob("ckpt-*.pt"))[-1])["model"]
