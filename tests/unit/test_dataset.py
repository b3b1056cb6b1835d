"""Dataset resolution: sorted classes, train's label map for every split, clear errors."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from helpers import build_loader, small_recipe
from PIL import Image

from stallfree.data.readers.factory import resolve_dataset
from stallfree.data.readers.folders import DatasetError, list_split
from stallfree.recipe import DataConfig


def _img(path: Path, value: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), (value, value, value)).save(path)


def test_sorted_classes_and_files_and_left_out_files_are_named(tmp_path: Path) -> None:
    for name in ("b/2.jpg", "b/1.png", "a/9.JPG", "c/x.jpeg"):
        _img(tmp_path / "train" / name)
    (tmp_path / "train" / "a" / "notes.txt").write_text("not an image")
    with pytest.warns(UserWarning, match=r"left out 1 file.*a/notes\.txt"):
        listing = list_split(tmp_path, "train")[0]
    assert listing.classes == ("a", "b", "c")
    assert [Path(p).name for p in listing.files] == ["9.JPG", "1.png", "2.jpg", "x.jpeg"]
    assert listing.labels.tolist() == [0, 1, 1, 2]


def test_empty_class_is_named(tmp_path: Path) -> None:
    _img(tmp_path / "train" / "a" / "1.jpg")
    (tmp_path / "train" / "empty").mkdir()
    with pytest.raises(DatasetError, match="empty has no images"):
        list_split(tmp_path, "train")[0]


def test_empty_or_missing_split(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        list_split(tmp_path, "val")[0]
    (tmp_path / "val").mkdir()
    with pytest.raises(DatasetError, match="no class folders"):
        list_split(tmp_path, "val")[0]


def test_file_list_filters(tmp_path: Path) -> None:
    for split in ("train", "val"):
        for name in ("a/1.jpg", "a/2.jpg", "b/3.jpg"):
            _img(tmp_path / split / name)
    (tmp_path / "train" / "a" / "anim.gif").write_bytes(b"GIF89a")
    keep = tmp_path / "clean.txt"
    keep.write_text(f"# checked\ntrain/a/2.jpg\ntrain/b/3.jpg\n{tmp_path}/val/b/3.jpg\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dataset = resolve_dataset(DataConfig(root=str(tmp_path), file_list=str(keep)))
    # The .gif is not in the list: nothing to leave out. Val class a has no listed image.
    assert [str(w.message) for w in caught if "left out" in str(w.message)] == []
    assert any("no images for 1 training class" in str(w.message) for w in caught)
    assert [Path(p).name for p in dataset.splits["train"].files] == ["2.jpg", "3.jpg"]
    assert dataset.splits["val"].labels.tolist() == [1]


def _two_class_root(root: Path) -> None:
    for cls, value in (("ant", 10), ("bee", 200)):
        for i in range(2):
            _img(root / "train" / cls / f"{i}.png", value)
    for i in range(2):
        _img(root / "val" / "bee" / f"{i}.png", 200)  # val lacks the first class


@pytest.mark.parametrize("backend", ["torch", pytest.param("dali", marks=pytest.mark.dali), "synthetic"])
def test_val_labels_follow_train_classes(tmp_path: Path, backend: str) -> None:
    _two_class_root(tmp_path)
    with pytest.warns(UserWarning, match="no folder or no images for 1 training class.*ant"):
        dataset = resolve_dataset(DataConfig(root=str(tmp_path)))
    assert dataset.classes == ("ant", "bee") and dataset.num_classes == 2
    assert dataset.splits["val"].labels.tolist() == [1, 1]  # "bee" is 1, as in train: not val's own 0
    if backend == "synthetic":
        return
    recipe = small_recipe(tmp_path, loader={"backend": backend}, train={"batch_size": 2})
    loader = build_loader(recipe, "val", device=torch.device("cpu"), dataset=dataset)
    labels = torch.cat([b.labels for b in loader])
    loader.close()
    assert labels.tolist() == [1, 1]


def test_val_class_unknown_to_train_is_an_error(tmp_path: Path) -> None:
    _two_class_root(tmp_path)
    _img(tmp_path / "val" / "wasp" / "0.png")
    with pytest.raises(DatasetError, match="lacks: wasp"):
        resolve_dataset(DataConfig(root=str(tmp_path)))
