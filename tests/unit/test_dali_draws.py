"""One augmentation stream: the DALI loader crops, flips, augments and erases each training
sample as the torch loader does, from the sample's own seed, and keeps no random state."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import build_loader, small_recipe
from PIL import Image

from stallfree.data.readers.imageio import displayed_size
from stallfree.data.sharding import sample_seeds
from stallfree.data.tools.demo import write_demo
from stallfree.data.transforms.draws import draw_train
from stallfree.data.transforms.policies import SUITES
from stallfree.parallel import DistInfo

pytestmark = pytest.mark.dali
CPU = torch.device("cpu")
RAW_PIXELS = {"mean": [0.0, 0.0, 0.0], "std": [1 / 255] * 3}  # "normalised" = uint8 values
# Per image, the mean absolute difference in grey levels between the loaders' crops, measured on
# the demo photos at 64 px: worst 3.1, mean 1.08 (the torch backend decodes a large crop
# DCT-scaled, DALI in full; 0.19 worst where both decode in full, as on the tiny images below).
# Validation's, at 64 px, is 1.8 worst and 0.74 mean. Another crop differs by 50 and more.
CROP_TOLERANCE, CROP_MEAN_TOLERANCE = 4.0, 1.5
# Operations whose output jumps with a grey level of input (a histogram's or a threshold's):
# the same operation on the two decoders' crops (measured worst 0.74 on the tiny images, 28 on
# the demo photos' DCT-scaled crops).
AMPLIFYING = {"equalize", "auto_contrast", "solarize", "posterize"}
AMPLIFIED_TOLERANCE = 32.0
# Strict mode (loader.torch.exact_decode): both decode in full, so the crops differ by the two
# resizes' rounding only (measured 0.2-0.4 worst on photo-like data, benchmarks/train_parity.py).
STRICT_TOLERANCE = 1.0


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 small images in 2 classes: JPEGs of several shapes, one EXIF-rotated, one PNG."""
    root = tmp_path_factory.mktemp("tiny")
    rng = np.random.default_rng(0)
    shapes = [(96, 72), (72, 96), (120, 90), (64, 64), (160, 100), (80, 120)]
    for i in range(12):
        folder = root / "train" / f"c{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        w, h = shapes[i % len(shapes)]
        y, x = np.mgrid[0:h, 0:w]
        pixels = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (w + h)], axis=-1)
        blob = rng.integers(0, max(1, min(w, h) - 24), 2)
        pixels[blob[1] : blob[1] + 20, blob[0] : blob[0] + 24] = rng.integers(0, 256, 3)
        img = Image.fromarray(pixels.astype(np.uint8))
        if i == 5:
            exif = Image.Exif()
            exif[0x0112] = 6  # displayed rotated: the crop box is in displayed pixels
            img.save(folder / f"{i}.jpg", exif=exif.tobytes(), quality=95)
        elif i == 7:
            img.save(folder / f"{i}.png")
        else:
            img.save(folder / f"{i}.jpg", quality=95)
    (root / "val").symlink_to(root / "train")  # the listing wants both splits
    return root


@pytest.fixture(scope="module")
def photo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """20 photo-like train JPEGs (`data demo --photo-like`: textured, short side 333-500 px),
    where the torch loader's DCT-scaled decode moves a small crop by several grey levels."""
    return write_demo(
        tmp_path_factory.mktemp("photo"),
        train_per_class=2,
        val_per_class=1,
        seed=2,
        photo_like=True,
        progress=False,
    )


def _epochs(
    recipe, backend: str, dist: DistInfo, device: torch.device = CPU
) -> tuple[list[torch.Tensor], list[list[tuple[str, ...]]]]:
    """Two epochs of one rank: the images, and each sample's operations as the draws name them."""
    recipe.loader.backend = backend
    loader = build_loader(recipe, "train", device=device, dist=dist)
    images, ops = [], []
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        ids = np.concatenate(list(loader.remaining_ids()))
        seeds = sample_seeds(loader.epoch_order()[1], ids).tolist()
        paths = loader.spec.listing.paths(ids)
        aug, side = recipe.augment, loader.spec.crop_size(epoch)
        suite = SUITES.get(aug.auto_augment, ())
        drawn = [draw_train(*displayed_size(p), aug, side, s) for p, s in zip(paths, seeds)]
        ops.append([tuple(suite[i].name for i, _, _ in d.ops) for d in drawn])
        images.append(torch.cat([batch.images.float().cpu() for batch in loader]))
    loader.close()
    return images, ops


@pytest.mark.parametrize(
    "augment, world_size",
    [
        ({}, 1),
        ({}, 2),
        ({"random_erasing": 0.5}, 1),
        ({"random_erasing": 0.5}, 2),
        # A policy's graph takes seconds to build: its two ranks cover one rank's samples too.
        ({"auto_augment": "randaugment", "random_erasing": 0.5}, 2),
    ],
    ids=["crop-flip-1", "crop-flip-2", "erasing-1", "erasing-2", "randaugment-erasing-2"],
)
def test_both_loaders_augment_every_sample_alike(tiny_root: Path, augment: dict, world_size: int) -> None:
    recipe = small_recipe(
        tiny_root, augment={**RAW_PIXELS, "image_size": 48, **augment}, train={"batch_size": 2}
    )
    for rank in range(world_size):
        dist = DistInfo(rank, world_size)
        torch_images, ops = _epochs(recipe, "torch", dist)
        dali_images, _ = _epochs(recipe, "dali", dist)
        for epoch, (ours, theirs, names) in enumerate(zip(torch_images, dali_images, ops)):
            assert ours.shape == theirs.shape and len(names) == len(ours)
            per_image = (ours - theirs).abs().flatten(1).mean(1)
            smooth = torch.tensor([not AMPLIFYING & set(n) for n in names])
            assert per_image[smooth].max() <= CROP_TOLERANCE, (rank, epoch, per_image.tolist())
            assert per_image[smooth].mean() <= CROP_MEAN_TOLERANCE, (rank, epoch, per_image.tolist())
            assert per_image.max() <= AMPLIFIED_TOLERANCE, (rank, epoch, per_image.tolist(), names)


@pytest.mark.parametrize("size", [32, 224])
def test_strict_mode_crops_within_a_grey_level_of_dali(photo_root: Path, size: int) -> None:
    """loader.torch.exact_decode: the torch loader decodes in full, as DALI does, and every
    train crop is within one grey level of DALI's at a small size as at 224 px."""
    recipe = small_recipe(
        photo_root,
        augment={**RAW_PIXELS, "image_size": size, "resize_size": size},
        train={"batch_size": 4},
        loader={"torch": {"exact_decode": True}},
    )
    torch_images, _ = _epochs(recipe, "torch", DistInfo())
    dali_images, _ = _epochs(recipe, "dali", DistInfo())
    for ours, theirs in zip(torch_images, dali_images, strict=True):
        per_image = (ours - theirs).abs().flatten(1).mean(1)
        assert per_image.max() <= STRICT_TOLERANCE, per_image.tolist()


@pytest.mark.gpu
def test_the_mixed_graph_crops_as_the_cpu_graph(tiny_root: Path) -> None:
    """nvJPEG's ROI decode (`mixed`) and DALI's GPU operators, handed the same draws: the CPU
    graph's crops, within the decoders' few grey levels (validation's check allows 3)."""
    augment = {**RAW_PIXELS, "image_size": 48, "auto_augment": "randaugment", "random_erasing": 0.5}
    recipe = small_recipe(tiny_root, augment=augment, train={"batch_size": 2, "device": "cuda"})
    gpu, ops = _epochs(recipe, "dali", DistInfo(), torch.device("cuda"))
    cpu, _ = _epochs(recipe, "dali", DistInfo())
    for ours, theirs, names in zip(gpu, cpu, ops):
        per_image = (ours - theirs).abs().flatten(1).mean(1)
        smooth = torch.tensor([not AMPLIFYING & set(n) for n in names])
        assert per_image[smooth].max() <= 3 and per_image.max() <= AMPLIFIED_TOLERANCE, per_image.tolist()


def test_a_runs_first_batches_show_the_same_crops(image_root: Path) -> None:
    """Through the public API, on the demo photos at 64 px: the first batches of epoch 0."""
    import stallfree

    recipe = small_recipe(image_root, augment={**RAW_PIXELS, "image_size": 64, "resize_size": 73})
    first = {}
    for backend in ("torch", "dali"):
        loader = stallfree.loader(recipe, "train", device="cpu", loader__backend=backend)
        batches = iter(loader)
        first[backend] = torch.cat([next(batches).images for _ in range(2)])
        loader.close()
    per_image = (first["torch"] - first["dali"]).abs().flatten(1).mean(1)
    assert per_image.max() <= CROP_TOLERANCE and per_image.mean() <= CROP_MEAN_TOLERANCE, per_image.tolist()
