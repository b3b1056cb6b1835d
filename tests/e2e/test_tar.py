"""WebDataset tar shards: packing, both loaders reading them in place, safety, resume."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest
import torch
from helpers import build_loader, small_recipe

from stallfree.cli import main
from stallfree.data import storage
from stallfree.data.readers.tarshards import read_index
from stallfree.data.tools.pack import write_index
from stallfree.parallel import DistInfo
from stallfree.train.checkpoint import load_checkpoint
from stallfree.train.run import train

pytestmark = pytest.mark.e2e  # every test here trains a run or starts a process

BACKENDS = ["torch", pytest.param("dali", marks=pytest.mark.dali)]
RAW_PIXELS = {"mean": [0.0, 0.0, 0.0], "std": [1 / 255] * 3}
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def packed(image_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("packed")
    assert main(["data", "pack", str(image_root), str(out), "--shard-size", "200KB", "--no-progress"]) == 0
    return out


def test_pack_writes_shards_indexes_and_a_manifest(image_root: Path, packed: Path) -> None:
    manifest = json.loads((packed / "manifest.json").read_text())
    assert manifest["classes"] == sorted(p.name for p in (image_root / "train").iterdir())
    train_shards = manifest["splits"]["train"]["shards"]
    assert len(train_shards) > 1 and sum(s["samples"] for s in train_shards) == 60
    # --shard-size is a bound, except for a shard that holds one image larger than it.
    assert all(s["bytes"] <= 200_000 or s["samples"] == 1 for s in train_shards)
    originals = {p.read_bytes() for p in image_root.glob("train/*/*.jpg")}
    with tarfile.open(packed / train_shards[0]["name"]) as tar:
        images = [tar.extractfile(m).read() for m in tar if m.name.endswith(".jpg")]
    assert images and all(data in originals for data in images)  # byte for byte
    first = (packed / train_shards[0]["name"]).with_suffix(".idx").read_text().splitlines()
    assert first[0] == f"v1.2 {train_shards[0]['samples']}"
    assert first[1].split()[0] == "jpg" and first[1].split()[4] == "cls"


@pytest.mark.parametrize("backend", BACKENDS)
def test_shards_give_the_folders_samples_under_two_ranks(
    image_root: Path, packed: Path, backend: str
) -> None:
    def epoch(root: Path, fmt: str, split: str) -> tuple[list[int], torch.Tensor]:
        # batch 6 x 2 ranks divides the 60 train images: every sample is seen once.
        recipe = small_recipe(
            root,
            data={"format": fmt},
            loader={"backend": backend},
            augment=RAW_PIXELS,
            train={"batch_size": 6},
        )
        labels, images = [], []
        for rank in range(2):
            loader = build_loader(recipe, split, device=CPU, dist=DistInfo(rank, 2))
            batches = list(loader)
            loader.close()
            labels += [label for b in batches for label in b.labels.tolist()]
            images += [b.images for b in batches]
        return sorted(labels), torch.cat(images)

    folder_train, _ = epoch(image_root, "folder", "train")
    tar_train, _ = epoch(packed, "tar", "train")
    assert len(tar_train) == 60 and tar_train == folder_train
    folder_val, folder_images = epoch(image_root, "folder", "val")
    tar_val, tar_images = epoch(packed, "tar", "val")
    assert tar_val == folder_val and torch.equal(tar_images, folder_images)  # val is unshuffled


def test_unsafe_members_are_never_read(tmp_path: Path) -> None:
    shard = tmp_path / "evil.tar"
    good = io.BytesIO()
    from PIL import Image

    Image.new("RGB", (8, 8)).save(good, "JPEG")
    with tarfile.open(shard, "w") as tar:
        for name, data in (
            ("ok.jpg", good.getvalue()),
            ("ok.cls", b"0"),
            ("../up.jpg", good.getvalue()),
            ("../up.cls", b"0"),
            ("/abs.jpg", good.getvalue()),
            ("/abs.cls", b"0"),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("link.jpg")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
        link_cls = tarfile.TarInfo("link.cls")
        link_cls.size = 1
        tar.addfile(link_cls, io.BytesIO(b"0"))
    write_index(shard)
    assert [entry[0] for entry in read_index(storage.locate(shard))] == ["ok.jpg"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil.idx", "evil.tar"]  # nothing extracted


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_from_shards_is_bitwise(packed: Path, tmp_path: Path, backend: str) -> None:
    recipe = small_recipe(
        packed,
        data={"format": "tar"},
        loader={"backend": backend},
        train={"epochs": 2, "accum_steps": 2, "ckpt_every_steps": 1, "keep_checkpoints": 20},
        optim={"name": "sgd", "lr": 0.05},
    )
    full = tmp_path / "full"
    train(recipe, full, progress=False)
    run = tmp_path / "resumed"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(full / "checkpoints" / "ckpt-000000005.pt", run / "checkpoints")
    train(recipe, run, progress=False, resume="auto")
    final = load_checkpoint(full / "checkpoints" / "ckpt-000000008.pt")
    resumed = load_checkpoint(run / "checkpoints" / "ckpt-000000008.pt")
    for name, tensor in final["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name
