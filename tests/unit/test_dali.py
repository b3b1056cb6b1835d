"""DALI backend: parity with torch, odd inputs, sharding, errors. CPU here; GPU tests marked."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import build_loader, small_recipe
from PIL import Image

from stallfree.parallel import DistInfo

pytestmark = pytest.mark.dali
CPU = torch.device("cpu")
RAW_PIXELS = {"mean": [0.0, 0.0, 0.0], "std": [1 / 255] * 3}  # "normalised" = uint8 values


def _all(
    recipe, split: str, backend: str, dist: DistInfo | None = None, epoch: int = 0, device: torch.device = CPU
) -> tuple[torch.Tensor, torch.Tensor]:
    recipe.loader.backend = backend
    loader = build_loader(recipe, split, device=device, dist=dist or DistInfo())
    loader.set_epoch(epoch)
    batches = list(loader)
    loader.close()
    return torch.cat([b.images for b in batches]), torch.cat([b.labels for b in batches])


@pytest.mark.parametrize("size, resize", [(32, 36), (64, 73)])
def test_val_parity_with_torch_under_two_grey_levels(image_root: Path, size: int, resize: int) -> None:
    recipe = small_recipe(image_root, augment={"image_size": size, "resize_size": resize, **RAW_PIXELS})
    dali_images, dali_labels = _all(recipe, "val", "dali")
    torch_images, torch_labels = _all(recipe, "val", "torch")
    assert torch.equal(dali_labels, torch_labels)
    assert float(torch_images.max()) > 200  # really uint8-scaled pixels
    diff = (dali_images - torch_images).abs().mean().item()
    assert diff < 2.0, f"mean abs difference {diff:.3f} grey levels"


@pytest.mark.parametrize("world_size", [1, 2])
def test_same_samples_in_the_same_order_as_torch(image_root: Path, world_size: int) -> None:
    recipe = small_recipe(image_root, augment=RAW_PIXELS)
    for rank in range(world_size):
        dist = DistInfo(rank, world_size)
        for epoch in (0, 1):
            _, dali_labels = _all(recipe, "train", "dali", dist, epoch)
            _, torch_labels = _all(recipe, "train", "torch", dist, epoch)
            assert torch.equal(dali_labels, torch_labels), (rank, epoch)
        # val is unshuffled: the images themselves identify the samples
        dali_val, _ = _all(recipe, "val", "dali", dist)
        torch_val, _ = _all(recipe, "val", "torch", dist)
        assert dali_val.shape == torch_val.shape
        assert (dali_val - torch_val).abs().flatten(1).mean(1).max() < 4


def test_train_crops_are_random_but_seeded(image_root: Path) -> None:
    recipe = small_recipe(image_root)
    a, _ = _all(recipe, "train", "dali", epoch=0)
    b, _ = _all(recipe, "train", "dali", epoch=0)
    c, _ = _all(recipe, "train", "dali", epoch=1)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def _odd_images(root: Path) -> dict[str, Path]:
    """One file per awkward kind, in a one-class ImageFolder."""
    folder = root / "val" / "odd"
    folder.mkdir(parents=True)
    (root / "train").mkdir()
    (root / "train" / "odd").symlink_to(folder)
    # Smooth content with an asymmetric feature: resampling noise stays small, a missed
    # rotation or channel mix-up does not.
    y, x = np.mgrid[0:180, 0:240]
    pixels = np.stack([x * 255 / 240, y * 255 / 180, 255 - x * 255 / 240], axis=-1)
    pixels[20:70, 30:90] = (250, 40, 40)
    base = Image.fromarray(pixels.astype(np.uint8))
    files = {
        "gray": ("gray.jpg", base.convert("L"), {}),
        "cmyk": ("cmyk.jpg", base.convert("CMYK"), {}),
        "palette": ("palette.png", base.convert("P"), {}),
        "rgba": ("rgba.png", base.convert("RGBA"), {}),
        "png_named_jpg": ("png_named.jpg", base, {"format": "PNG"}),
        "progressive": ("progressive.jpg", base, {"progressive": True, "quality": 90}),
    }
    out = {}
    for kind, (name, img, kwargs) in files.items():
        img.save(folder / name, **kwargs)
        out[kind] = folder / name
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    base.save(folder / "exif_rotated.jpg", exif=exif.tobytes(), quality=95)
    out["exif"] = folder / "exif_rotated.jpg"
    return out


def test_odd_inputs_decode_to_rgb_in_both_backends(tmp_path: Path) -> None:
    _odd_images(tmp_path)
    # Non-square output would reveal a missed EXIF rotation: use a tall crop region via val.
    recipe = small_recipe(
        tmp_path, augment={"image_size": 64, "resize_size": 64, **RAW_PIXELS}, train={"batch_size": 7}
    )
    results = {b: _all(recipe, "val", b)[0] for b in ("dali", "torch")}
    for images in results.values():
        assert images.shape == (7, 3, 64, 64)
    per_file = (results["dali"] - results["torch"]).abs().flatten(1).mean(1)
    # CMYK conversion differs slightly between decoders; everything else agrees closely.
    assert per_file.max() < 12, per_file
    assert per_file.median() < 2, per_file
    # An ignored EXIF rotation would give a different picture in one backend, not a small diff.
    train_images, _ = _all(recipe, "train", "dali")
    assert train_images.shape[1] == 3


def test_exif_rotation_is_applied(tmp_path: Path) -> None:
    files = _odd_images(tmp_path)
    stored = Image.open(files["exif"])
    assert stored.size == (240, 180)  # stored landscape, displayed portrait
    recipe = small_recipe(
        tmp_path, augment={"image_size": 64, "resize_size": 64, **RAW_PIXELS}, train={"batch_size": 7}
    )
    images, _ = _all(recipe, "val", "dali")
    torch_images, _ = _all(recipe, "val", "torch")
    names = sorted(p.name for p in files.values())
    i = names.index("exif_rotated.jpg")
    assert (images[i] - torch_images[i]).abs().mean() < 2


def test_channels_last_output(image_root: Path) -> None:
    recipe = small_recipe(image_root, train={"channels_last": True})
    images, _ = _all(recipe, "val", "dali")
    assert images.shape[1:] == (3, 32, 32)
    assert images.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.gpu
@pytest.mark.parametrize("decode", ["auto", "cpu"])
@pytest.mark.parametrize(
    "precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)]
)
def test_gpu_pipeline_outputs_on_cuda(
    image_root: Path, decode: str, precision: str, dtype: torch.dtype
) -> None:
    recipe = small_recipe(image_root, loader={"dali": {"decode": decode}}, train={"precision": precision})
    images, labels = _all(recipe, "train", "dali", device=torch.device("cuda"))
    assert images.is_cuda and labels.is_cuda
    assert images.dtype == dtype and images.shape[1:] == (3, 32, 32)


@pytest.mark.gpu
def test_cpu_graph_feeding_a_gpu_run(image_root: Path) -> None:
    recipe = small_recipe(image_root, loader={"dali": {"device": "cpu"}}, train={"precision": "bf16"})
    images, labels = _all(recipe, "train", "dali", device=torch.device("cuda"))
    assert images.is_cuda and labels.is_cuda and images.dtype == torch.bfloat16


@pytest.mark.gpu
def test_gpu_mixed_decoder_matches_cpu_val(image_root: Path) -> None:
    recipe = small_recipe(image_root, augment=RAW_PIXELS)
    gpu, _ = _all(recipe, "val", "dali", device=torch.device("cuda"))
    cpu, _ = _all(recipe, "val", "dali")
    # nvJPEG's IDCT and chroma upsampling differ from libjpeg-turbo's by a few grey levels.
    assert (gpu.float().cpu() - cpu).abs().mean() < 3


def test_one_pipeline_serves_the_whole_run(image_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Epochs reset the pipeline instead of rebuilding it (a rebuild cost ~0.5 s an epoch),
    and each epoch still follows its own order."""
    import stallfree.data.backends.dali_backend as dali_backend

    builds = []
    original = dali_backend.image_pipeline
    monkeypatch.setattr(dali_backend, "image_pipeline", lambda **kw: builds.append(1) or original(**kw))
    recipe = small_recipe(image_root, loader={"backend": "dali"}, augment=RAW_PIXELS)
    loader = build_loader(recipe, "train", device=CPU)
    reference = build_loader(small_recipe(image_root, augment=RAW_PIXELS), "train", device=CPU)
    for epoch in range(3):
        loader.set_epoch(epoch)
        reference.set_epoch(epoch)
        labels = torch.cat([b.labels for b in loader])
        assert torch.equal(labels, torch.cat([b.labels for b in reference]))  # torch's order
    assert len(builds) == 1
    loader.close()
    reference.close()


def test_a_stop_on_an_epochs_last_batch_resumes_pixel_for_pixel(image_root: Path) -> None:
    """Stopped right after an epoch's last batch (its checkpoint: that epoch, at its end), a
    resumed loader's next epoch is the uninterrupted one's, pixel for pixel; the state holds
    positions only (the draws come from each sample's seed)."""
    recipe = small_recipe(image_root, loader={"backend": "dali"}, augment=RAW_PIXELS)
    reference = build_loader(recipe, "train", device=CPU)
    list(reference)
    stopped = build_loader(recipe, "train", device=CPU)
    list(stopped)
    saved = {**stopped.state_dict(), "position": stopped.plan.position_after(0, len(stopped))}
    assert not any("dali" in key for key in saved)
    stopped.close()
    resumed = build_loader(recipe, "train", device=CPU)
    resumed.load_state_dict(saved)
    assert list(resumed) == []  # nothing left of epoch 0
    for loader in (reference, resumed):
        loader.set_epoch(1)
    a, b = (torch.cat([batch.images for batch in loader]) for loader in (reference, resumed))
    assert torch.equal(a, b)
    reference.close()
    resumed.close()
