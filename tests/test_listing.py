"""The shared listing: sorted classes, known extensions, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from stallfree.data.listing import DatasetError, list_split


def _img(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8)).save(path)


def test_sorted_classes_and_files(tmp_path: Path) -> None:
    for name in ("b/2.jpg", "b/1.png", "a/9.JPG", "a/notes.txt", "c/x.jpeg"):
        target = tmp_path / "train" / name
        if name.endswith(".txt"):
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("not an image")
        else:
            _img(target)
    listing = list_split(tmp_path, "train")
    assert listing.classes == ("a", "b", "c")
    assert [Path(p).name for p in listing.files] == ["9.JPG", "1.png", "2.jpg", "x.jpeg"]
    assert listing.labels == [0, 1, 1, 2]


def test_empty_class_is_named(tmp_path: Path) -> None:
    _img(tmp_path / "train" / "a" / "1.jpg")
    (tmp_path / "train" / "empty").mkdir()
    with pytest.raises(DatasetError, match="empty has no images"):
        list_split(tmp_path, "train")


def test_empty_or_missing_split(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        list_split(tmp_path, "val")
    (tmp_path / "val").mkdir()
    with pytest.raises(DatasetError, match="no class folders"):
        list_split(tmp_path, "val")


def test_file_list_filters(tmp_path: Path) -> None:
    for name in ("a/1.jpg", "a/2.jpg", "b/3.jpg"):
        _img(tmp_path / "train" / name)
    keep = tmp_path / "clean.txt"
    keep.write_text("# checked\ntrain/a/2.jpg\ntrain/b/3.jpg\n")
    listing = list_split(tmp_path, "train", keep)
    assert [Path(p).name for p in listing.files] == ["2.jpg", "3.jpg"]
