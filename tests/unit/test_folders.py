"""Class folders as ImageFolder reads them: images in sub-folders of a class folder belong to
that class (never a class of their own, never dropped), in torchvision's order, for every
reader (both loaders, the file list, data check, data pack, the start-up check cache)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from helpers import build_loader, small_recipe
from PIL import Image

from stallfree.data.readers.factory import resolve_dataset
from stallfree.data.readers.folders import DatasetError, list_split
from stallfree.data.readers.imageio import IMAGE_EXTENSIONS, BadImageError
from stallfree.recipe import DataConfig

CPU = torch.device("cpu")
BACKENDS = ["torch", pytest.param("dali", marks=pytest.mark.dali)]
# Per class: 2 files at the top, 2 in nested/, 1 in nested/deeper/, 1 in "a b" and 1 in "a-b"
# ("a b" < "a-b" < "a/..." < "a0" by character: the folder order is by path, not by depth).
_LAYOUT = [
    "z.jpg",
    "b.png",
    "nested/1.jpg",
    "nested/0.jpg",
    "nested/deeper/x.jpg",
    "a b/q.jpg",
    "a-b/q.jpg",
    "a/q.jpg",
    "a0/q.jpg",
]


def _img(path: Path, value: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (16, 12), (value, 90, 255 - value)).save(path)


def _nested_root(root: Path) -> Path:
    for split in ("train", "val"):
        for c, name in enumerate(("brick", "clay")):
            for i, tail in enumerate(_LAYOUT):
                _img(root / split / name / tail, 10 * i + c)
    return root


def _image_folder_order(split_dir: Path) -> list[tuple[str, int]]:
    """torchvision.datasets.folder.make_dataset's loop (torchvision is not installed here)."""
    classes = sorted(e.name for e in os.scandir(split_dir) if e.is_dir())
    samples = []
    for label, name in enumerate(classes):
        for folder, _, files in sorted(os.walk(split_dir / name, followlinks=True)):
            for file in sorted(files):
                if file.lower().endswith(IMAGE_EXTENSIONS):
                    samples.append((os.path.join(folder, file), label))
    return samples


def test_images_in_sub_folders_belong_to_the_class_in_image_folder_order(tmp_path: Path) -> None:
    root = _nested_root(tmp_path)
    dataset = resolve_dataset(DataConfig(root=str(root)))
    assert dataset.classes == ("brick", "clay")  # nested/ is no class
    for split in ("train", "val"):
        listing = dataset.splits[split]
        assert list(zip(listing.files, listing.labels.tolist(), strict=True)) == _image_folder_order(
            root / split
        )
        assert len(listing) == 18


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_file_replaced_in_a_sub_folder_is_checked_again_at_start(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STALLFREE_CACHE", str(tmp_path / "cache"))
    root = _nested_root(tmp_path / "data")
    recipe = small_recipe(root, loader={"backend": backend}, train={"batch_size": 4})
    build_loader(recipe, "val", device=CPU).close()  # the header check, now cached
    fresh = root / "val" / "brick" / "nested" / "new.tmp"
    fresh.write_bytes(b"not an image")
    os.replace(fresh, root / "val" / "brick" / "nested" / "0.jpg")  # only nested/'s time moves
    with pytest.raises(BadImageError, match=r"nested/0\.jpg"):
        build_loader(recipe, "val", device=CPU)


def test_other_files_in_sub_folders_are_named_and_hidden_folders_skipped(tmp_path: Path) -> None:
    _img(tmp_path / "train" / "brick" / "1.jpg", 0)
    _img(tmp_path / "train" / "brick" / ".ipynb_checkpoints" / "1.jpg", 0)
    (tmp_path / "train" / "brick" / "nested").mkdir()
    (tmp_path / "train" / "brick" / "nested" / "notes.txt").write_text("x")
    with pytest.warns(UserWarning, match=r"left out 1 file.*brick/nested/notes\.txt"):
        listing = list_split(tmp_path, "train")[0]
    assert [Path(p).name for p in listing.files] == ["1.jpg"]


def test_a_class_with_images_only_in_sub_folders_is_no_empty_class(tmp_path: Path) -> None:
    _img(tmp_path / "train" / "brick" / "1.jpg", 0)
    _img(tmp_path / "train" / "clay" / "deep" / "1.jpg", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list_split(tmp_path, "train")[0].labels.tolist() == [0, 1]
    (tmp_path / "train" / "sand" / "empty").mkdir(parents=True)
    with pytest.raises(DatasetError, match="sand has no images"):
        list_split(tmp_path, "train")[0]


def test_a_folder_link_back_into_its_class_is_named(tmp_path: Path) -> None:
    _img(tmp_path / "train" / "brick" / "1.jpg", 0)
    (tmp_path / "train" / "brick" / "nested").mkdir()
    os.symlink("..", tmp_path / "train" / "brick" / "nested" / "up")  # os.walk would never end
    with pytest.raises(DatasetError, match=r"brick/nested/up links back to a folder above it"):
        list_split(tmp_path, "train")[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_file_list_without_any_image_of_a_train_class_is_an_error(tmp_path: Path, backend: str) -> None:
    root = _nested_root(tmp_path / "data")
    listed = tmp_path / "list.txt"
    listed.write_text(
        "train/brick/z.jpg\ntrain/brick/nested/0.jpg\nval/brick/z.jpg\nval/clay/z.jpg\n"
    )  # no train/clay line: as a folder, clay would be empty
    recipe = small_recipe(root, data={"file_list": str(listed)}, loader={"backend": backend})
    with pytest.raises(DatasetError, match=r"list\.txt names no train images of class 'clay'"):
        build_loader(recipe, "train", device=CPU)
