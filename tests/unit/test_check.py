"""`stallfree data check`: every odd file classified, and the clean list both loaders accept."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import build_loader, small_recipe
from PIL import Image

from stallfree.data.readers.imageio import BadImageError


def _jpeg(size: tuple[int, int] = (40, 30)) -> bytes:
    buffer = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def _odd_files() -> dict[str, tuple[bytes | Image.Image, str]]:
    """name -> (content, the problem kind the checker must report; "" for a good file)."""
    bomb = bytearray(_jpeg((16, 16)))
    sof = bomb.index(b"\xff\xc0")
    bomb[sof + 5 : sof + 9] = struct.pack(">HH", 30000, 30000)
    grey16 = Image.fromarray((np.arange(64 * 64).reshape(64, 64) * 16).astype(np.uint16))
    palette = Image.new("P", (32, 32), 3)
    palette.info["transparency"] = 3
    return {
        "zero.jpg": (b"", "zero bytes"),
        "text.jpg": (b"this is a text file, not a photo\n", "not an image"),
        "truncated.jpg": (_jpeg((300, 200))[:1500], "truncated"),
        "bomb.jpg": (bytes(bomb), "over the pixel limit"),
        "notes.txt": (b"hello", "not an image file type"),
        "cmyk.jpg": (Image.new("CMYK", (32, 32), (10, 200, 30, 0)), ""),
        "grey16.png": (grey16, ""),
        "palette_trns.png": (palette, ""),
        "good.jpg": (_jpeg(), ""),
    }


def _root_with_bad_train_files(root: Path) -> list[Path]:
    """10 good train images, 4 val, and 2 bad train files (truncated, bomb) among them."""
    for split, n in (("train", 10), ("val", 4)):
        folder = root / split / "a"
        folder.mkdir(parents=True)
        for k in range(n):
            (folder / f"{k:02d}.jpg").write_bytes(_jpeg())
    files = _odd_files()
    bad = [root / "train" / "a" / "03_truncated.jpg", root / "train" / "a" / "07_bomb.jpg"]
    bad[0].write_bytes(files["truncated.jpg"][0])
    bad[1].write_bytes(files["bomb.jpg"][0])
    return bad


def test_skip_on_torch_drops_the_bad_samples_and_duplicates_none(tmp_path: Path) -> None:
    bad = _root_with_bad_train_files(tmp_path)
    recipe = small_recipe(tmp_path, data={"on_error": "skip"}, train={"batch_size": 4})
    with pytest.warns(UserWarning, match="1 file.*will be left out.*07_bomb"):
        loader = build_loader(recipe, "train", device=torch.device("cpu"))
    with pytest.warns(UserWarning, match=r"skipped .*03_truncated\.jpg"):
        batches = list(loader)
    loader.close()
    # 12 files, batch 4: 3 batches with the epoch's order kept; the 2 bad ones leave holes.
    assert len(batches) == 3 and sum(b.labels.numel() for b in batches) == 10
    assert loader.skipped_samples == 2
    pixels = torch.cat([b.images for b in batches]).flatten(1)
    assert len({tuple(row[:64].tolist()) for row in pixels}) == 10  # no sample twice
    recipe.data.on_error = "raise"
    with pytest.raises(BadImageError, match="07_bomb"):
        build_loader(recipe, "train", device=torch.device("cpu"))
    assert bad[0].exists()
