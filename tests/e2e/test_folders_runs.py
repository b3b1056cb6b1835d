"""Class folders as ImageFolder reads them: images in sub-folders of a class folder belong to
that class (never a class of their own, never dropped), in torchvision's order, for every
reader (both loaders, the file list, data check, data pack, the start-up check cache)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import build_loader, small_recipe
from test_folders import BACKENDS, CPU, _nested_root

from stallfree.cli import main
from stallfree.data.readers.factory import resolve_dataset
from stallfree.data.tools.check import check_dataset
from stallfree.recipe import DataConfig


@pytest.mark.e2e  # starts worker or store-helper processes
@pytest.mark.parametrize("backend", BACKENDS)
def test_both_loaders_and_data_check_and_pack_take_nested_images(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STALLFREE_CACHE", str(tmp_path / "cache"))
    root = _nested_root(tmp_path / "data")
    recipe = small_recipe(root, loader={"backend": backend}, train={"batch_size": 4})
    loader = build_loader(recipe, "val", device=CPU)
    labels = [label for batch in loader for label in batch.labels.tolist()]
    loader.close()
    assert labels == [0] * 9 + [1] * 9
    report = check_dataset(root, workers=1, progress=False)
    assert len(report.good) == 36 and not report.bad
    assert report.per_class["train/brick"] == 9  # counted in its class, not as "nested"
    listed = tmp_path / "clean.txt"
    listed.write_text(report.clean_list())
    from_list = resolve_dataset(DataConfig(root=str(root), file_list=str(listed)))
    assert sorted(from_list.splits["train"].files) == sorted(
        resolve_dataset(DataConfig(root=str(root))).splits["train"].files
    )
    assert (
        main(["data", "pack", str(root), str(tmp_path / "packed"), "--no-progress", "--shard-size", "1MB"])
        == 0
    )
    manifest = json.loads((tmp_path / "packed" / "manifest.json").read_text())
    assert manifest["splits"]["train"]["samples"] == 18
