"""The torch backend's fast path (simplejpeg decode, torch resize) against its PIL path.

Both paths must give the same pixels (decode: bit for bit; resize: within one grey level), and
every file the fast path cannot take must go to PIL, which names what is wrong with it.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from helpers import exif_block, jpeg_with_segments
from PIL import Image

import stallfree.data.transforms.decode as decode
from stallfree.data.readers.imageio import BadImageError
from stallfree.data.transforms.augment import train_transform, val_transform
from stallfree.recipe import AugmentConfig

pytest.importorskip("simplejpeg")
SIDE = 64  # AUG's crop side, given to the transforms
AUG = AugmentConfig(image_size=SIDE, resize_size=72)
FULL_SCALE = AugmentConfig(image_size=200, resize_size=220)


def _photo(width: int = 320, height: int = 240) -> Image.Image:
    y, x = np.mgrid[0:height, 0:width]
    rng = np.random.default_rng(0)
    pixels = np.stack([x * 255 // width, y * 255 // height, (x ^ y) & 255], -1)
    pixels = np.clip(pixels + rng.normal(0, 12, pixels.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def _jpeg(tmp_path: Path, name: str, image: Image.Image, **save: object) -> Path:
    path = tmp_path / f"{name}.jpg"
    image.save(path, "JPEG", quality=90, **save)
    return path


KINDS = {
    "420": lambda: ({}, _photo()),
    "444": lambda: ({"subsampling": 0}, _photo()),
    "422": lambda: ({"subsampling": 1}, _photo()),
    "progressive": lambda: ({"progressive": True}, _photo()),
    "optimized_odd_size": lambda: ({"optimize": True}, _photo(333, 257)),
    "grey": lambda: ({}, _photo().convert("L")),
    "restart_markers": lambda: ({"restart_marker_blocks": 4}, _photo()),
    "exif_upright": lambda: ({"exif": _exif({0x0112: 1, 0x010F: "camera"})}, _photo()),
    "exif_without_orientation": lambda: ({"exif": _exif({0x010F: "camera"})}, _photo()),
}


def _exif(tags: dict[int, object]) -> bytes:
    exif = Image.Exif()
    for tag, value in tags.items():
        exif[tag] = value
    return exif.tobytes()


def _both(fn, path: Path, *args: object, monkeypatch: pytest.MonkeyPatch) -> tuple[np.ndarray, np.ndarray]:
    fast = fn(str(path), *args)
    with monkeypatch.context() as m:
        m.setattr(decode, "simplejpeg", None)
        slow = fn(str(path), *args)
    return fast.astype(int), slow.astype(int)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_fast_and_pil_paths_agree(tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    save, image = KINDS[kind]()
    path = _jpeg(tmp_path, kind, image, **save)
    assert decode.open_image(str(path), 10**9).data is not None  # really the fast path
    # The decode alone: the same libjpeg-turbo settings, the same pixels.
    full = (0, 0, *image.size)
    fast, slow = _both(
        lambda p: decode.decode_resized(decode.open_image(p, 10**9), full, *image.size),
        path,
        monkeypatch=monkeypatch,
    )
    assert np.array_equal(fast, slow)
    fast, slow = _both(val_transform, path, AUG, SIDE, monkeypatch=monkeypatch)
    assert fast.shape == slow.shape == (64, 64, 3) and np.abs(fast - slow).max() <= 1
    # A crop at full scale (the output is too big for a DCT-scaled decode), here upsampled:
    # torch and PIL round a few edge pixels differently (measured: 0.1% of them, by <= 4).
    fast, slow = _both(train_transform, path, FULL_SCALE, 200, 7, monkeypatch=monkeypatch)
    assert fast.shape == slow.shape and np.abs(fast - slow).mean() < 0.05


def test_a_dct_scaled_crop_matches_pil_draft(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A big photo and a small output: both paths decode at 1/2..1/8 scale; the crop box is
    rounded to whole pixels on the fast path (PIL resizes a sub-pixel box)."""
    smooth = _photo(200, 150).resize((2000, 1500), Image.BILINEAR)  # no pixel noise to shift
    path = _jpeg(tmp_path, "big", smooth)
    opened = decode.open_image(str(path), 10**9)
    assert decode.jpeg_reduction(opened, 250, 188) == 8
    assert decode.jpeg_reduction(opened, 250, 189) == 4
    small = AugmentConfig(image_size=32, resize_size=36, scale=[0.9, 1.0])
    for seed in range(4):
        fast, slow = _both(train_transform, path, small, 32, seed, monkeypatch=monkeypatch)
        assert np.abs(fast - slow).mean() < 1.0, seed


@pytest.mark.parametrize("kind", ["cmyk", "exif_rotated", "exif_unreadable", "png_named_jpg"])
def test_files_the_fast_path_cannot_take_go_to_pil(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    image = _photo()
    if kind == "cmyk":
        path = _jpeg(tmp_path, kind, image.convert("CMYK"))
    elif kind == "exif_rotated":
        path = _jpeg(tmp_path, kind, image, exif=_exif({0x0112: 6}))
    elif kind == "exif_unreadable":  # an IFD offset past the block: PIL decides
        path = _jpeg(tmp_path, kind, image, exif=b"Exif\x00\x00II*\x00\xff\xff\x00\x00")
    else:
        path = tmp_path / "png.jpg"
        image.save(path, "PNG")
    opened = decode.open_image(str(path), 10**9)
    assert opened.data is None and opened.img is not None
    fast, slow = _both(val_transform, path, AUG, SIDE, monkeypatch=monkeypatch)
    assert np.array_equal(fast, slow)
    if kind == "exif_rotated":
        assert (opened.width, opened.height) == (240, 320)


def test_broken_jpegs_are_named_by_either_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = io.BytesIO()
    _photo().save(data, "JPEG")
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(data.getvalue()[: len(data.getvalue()) // 2])
    for use_fast in (True, False):
        with monkeypatch.context() as m:
            if not use_fast:
                m.setattr(decode, "simplejpeg", None)
            with pytest.raises(BadImageError, match="truncated.jpg"):
                val_transform(str(truncated), AUG, SIDE)


def test_the_pixel_limit_holds_on_the_fast_path(tmp_path: Path) -> None:
    path = _jpeg(tmp_path, "limit", _photo())
    with pytest.raises(BadImageError, match="max_pixels"):
        train_transform(str(path), AUG, SIDE, 0, max_pixels=320 * 240 - 1)


def _exif_in_comment(tmp_path: Path) -> Path:
    """Issue 24 (3): an upright EXIF block inside a comment (COM), then the real one (APP1)
    saying orientation 6. PIL and DALI read the APP1 block only."""
    return jpeg_with_segments(
        tmp_path / "com_exif.jpg", [(0xFE, exif_block(1)), (0xE1, exif_block(6))], size=(96, 72)
    )


def test_exif_orientation_is_read_from_app1_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _exif_in_comment(tmp_path)
    opened = decode.open_image(str(path), 10**9)
    assert (opened.width, opened.height) == (72, 96)  # rotated, as PIL sees it
    fast, slow = _both(val_transform, path, AUG, SIDE, monkeypatch=monkeypatch)
    assert np.abs(fast - slow).mean() <= 2, np.abs(fast - slow).mean()


@pytest.mark.dali
def test_exif_orientation_from_app1_matches_dali(tmp_path: Path) -> None:
    from test_decode import _dali

    path = _exif_in_comment(tmp_path)
    (dali,) = _dali([path], AUG)
    fast = val_transform(str(path), AUG, SIDE).astype(int)
    assert np.abs(fast - dali.astype(int)).mean() <= 2, np.abs(fast - dali.astype(int)).mean()
