"""Other people's WebDataset shards: the samples webdataset itself reads, and every shard that
cannot be read named in one line (never a silently shorter epoch, never a traceback)."""

from __future__ import annotations

import gzip
import io
import re
import tarfile
from pathlib import Path
from unittest import mock

import pytest
import torch
from helpers import build_loader, small_recipe
from PIL import Image

from stallfree.cli import main
from stallfree.data.readers.factory import resolve_dataset
from stallfree.data.readers.tarshards import ShardError
from stallfree.data.tools.check import check_dataset
from stallfree.recipe import DataConfig

CPU = torch.device("cpu")
BACKENDS = ["torch", pytest.param("dali", marks=pytest.mark.dali)]


def _jpeg(value: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (12, 10), (value, 255 - value, 40)).save(buffer, "JPEG")
    return buffer.getvalue()


def _shard(path: Path, members: list[tuple[str, bytes]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _samples(
    keys: list[tuple[str, int]], image_ext: str = "jpg", cls_ext: str = "cls"
) -> list[tuple[str, bytes]]:
    return [
        member
        for n, (key, label) in enumerate(keys)
        for member in ((f"{key}.{image_ext}", _jpeg(20 * n)), (f"{key}.{cls_ext}", str(label).encode()))
    ]


def test_a_key_with_dots_is_named_as_webdataset_groups_it(tmp_path: Path) -> None:
    # webdataset's key ends at the first dot of the name: x.y.0000.jpg is sample "x" with the
    # field "y.0000.jpg", which is no image; such images must be named, not dropped.
    for split in ("train", "val"):
        _shard(tmp_path / split / "a.tar", _samples([("k0000", 0), ("x.y.0001", 0), ("x.y.0002", 0)]))
    with pytest.raises(ShardError, match=r"a\.tar::x\.y\.0001\.jpg.*sample 'x'.*'y\.0001\.jpg'"):
        resolve_dataset(DataConfig(root=str(tmp_path), format="tar"))


def _two_splits(root: Path) -> None:
    for split in ("train", "val"):
        _shard(root / split / "a.tar", _samples([("k0000", 0), ("k0001", 1)]))


def _all_decode(paths: list[str], *_: object, **__: object) -> list[str | None]:
    """decode_all where every sample decodes: `data check` goes on to the other shards' samples
    (in worker processes), which are not the subject where a shard is refused."""
    return [None] * len(paths)


def _refused_by_both_loaders_and_check(root: Path, needle: str, backend: str) -> None:
    recipe = small_recipe(root, data={"format": "tar"}, loader={"backend": backend})
    with pytest.raises(ShardError, match=needle) as caught:
        build_loader(recipe, "train", device=CPU)
    assert "\n" not in str(caught.value)  # one line
    with mock.patch("stallfree.data.tools.check.decode_all", _all_decode):
        report = check_dataset(root, workers=1, progress=False)
    found = [*report.bad_shards, *report.bad]
    assert found and any(re.search(needle, reason) for _, reason in found)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("alone", [False, True])
def test_a_compressed_shard_beside_plain_ones_is_refused_by_name(
    tmp_path: Path, backend: str, alone: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STALLFREE_CACHE", str(tmp_path / "cache"))
    _two_splits(tmp_path)
    plain = _shard(tmp_path / "b.tar", _samples([("k0002", 0), ("k0003", 1)]))
    (tmp_path / "train" / "b.tar.gz").write_bytes(gzip.compress(plain.read_bytes()))
    plain.unlink()
    if alone:  # train holds compressed shards only: still shards, not an empty folder dataset
        (tmp_path / "train" / "a.tar").unlink()
    _refused_by_both_loaders_and_check(tmp_path, r"train/b\.tar\.gz is a compressed shard.*gunzip", backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "content,needle",
    [
        (b"", r"train/b\.tar is empty \(0 bytes\)"),
        ("gzip", r"train/b\.tar is gzip-compressed, not a plain tar.*gunzip"),
        (b"not a tar at all " * 64, r"train/b\.tar is not a tar file"),
    ],
)
def test_an_empty_or_disguised_shard_is_one_line_naming_it(
    tmp_path: Path, backend: str, content: bytes | str, needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STALLFREE_CACHE", str(tmp_path / "cache"))
    _two_splits(tmp_path)
    bad = tmp_path / "train" / "b.tar"
    if content == "gzip":
        content = gzip.compress(_shard(tmp_path / "x.tar", _samples([("k2", 0)])).read_bytes())
    bad.write_bytes(content)
    _refused_by_both_loaders_and_check(tmp_path, needle, backend)
    monkeypatch.setattr("stallfree.data.tools.check.decode_all", _all_decode)
    rc = main(["data", "check", str(tmp_path), "--no-progress", "--workers", "1"])
    assert rc == 1
