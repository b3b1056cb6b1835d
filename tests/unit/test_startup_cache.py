"""The start-up header check and its cache: what may vouch for a root's
files, and what both loaders do with a file the cache could not know about."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import build_loader, small_recipe
from PIL import Image
from test_loaders import _bomb_jpeg as _bomb  # a ~1 KB JPEG that says 30000 x 30000

from stallfree.data.readers.imageio import BadImageError

CPU = torch.device("cpu")
BACKENDS = ["torch", pytest.param("dali", marks=pytest.mark.dali)]


def _root(root: Path, per_class: int = 4) -> Path:
    for split in ("train", "val"):
        for c, base in (("a", 0), ("b", 100)):
            (root / split / c).mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                Image.new("RGB", (40, 30), (base + 30 * i, 90, 60)).save(
                    root / split / c / f"{i}.jpg", quality=90
                )
    return root


def _in_place(path: Path, data: bytes) -> None:
    """Rewrite a file in place (same inode): its folder's modification time does not move."""
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(data)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("STALLFREE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _build(root: str | Path, backend: str, **data: object) -> None:
    recipe = small_recipe(root, loader={"backend": backend}, train={"batch_size": 2}, data=dict(data))
    build_loader(recipe, "train", device=CPU).close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_relative_root_does_not_share_the_cache_with_a_copy(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """Item 4: X/ds checked, copied to Y/ds (times kept), a bomb put in place of one file:
    data.root = "ds" from Y is another dataset, and its check runs."""
    _root(tmp_path / "X" / "ds")
    monkeypatch.chdir(tmp_path / "X")
    _build("ds", backend)  # checked, cached
    shutil.copytree(tmp_path / "X" / "ds", tmp_path / "Y" / "ds")  # copystat: same times
    victim = tmp_path / "Y" / "ds" / "train" / "a" / "1.jpg"
    _in_place(victim, _bomb())
    monkeypatch.chdir(tmp_path / "Y")
    with pytest.raises(BadImageError, match="data.max_pixels") as info:
        _build("ds", backend)
    assert Path(info.value.path).resolve() == victim.resolve()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("edited", [{"bad": {}}, {"version": "x", "bad": {}}, [], {"bad": {"a": 1}}])
def test_an_edited_cache_entry_is_ignored_and_the_check_rerun(
    tmp_path: Path, cache: Path, backend: str, edited: object
) -> None:
    """Item 7: a cache file that is not as it was written is ignored (with a warning) and the
    check runs again: the bomb is refused at start."""
    root = _root(tmp_path / "data")
    (root / "train" / "a" / "3.jpg").write_bytes(_bomb())
    with pytest.raises(BadImageError):
        _build(root, backend)
    entries = sorted(cache.glob("headers-*.json"))
    assert entries
    for entry in entries:
        entry.write_text(json.dumps(edited))
    with pytest.warns(UserWarning, match="ignored"), pytest.raises(BadImageError, match="3.jpg"):
        _build(root, backend)
