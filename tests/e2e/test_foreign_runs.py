"""Other people's WebDataset shards: the samples webdataset itself reads, and every shard that
cannot be read named in one line (never a silently shorter epoch, never a traceback)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import build_loader, small_recipe
from test_foreign import BACKENDS, CPU, _samples, _shard

from stallfree.data.readers.factory import resolve_dataset
from stallfree.data.tools.check import check_dataset
from stallfree.recipe import DataConfig

# Keys as real shards have them: a class folder in front, a dot in a folder name, upper-case
# extensions, webdataset's own __meta__ members (which it skips).
_KEYS = [
    ("k0000", 0),
    ("cat/k0001", 1),
    ("cat/k0002", 1),
    ("dog.v2/k0003", 0),
    ("deep/er/k0004", 1),
    ("k0005", 0),
]


def _real_world_shards(root: Path) -> None:
    for split in ("train", "val"):
        members = (
            _samples(_KEYS[:3])
            + [("__meta__", b"{}")]
            + _samples(_KEYS[3:5], "JPG", "CLS")
            + _samples(_KEYS[5:])
        )
        _shard(root / split / "a.tar", members[:7])
        _shard(root / split / "b.tar", members[7:])


def _webdataset_reads(root: Path, split: str) -> list[tuple[str, int]]:
    wds = pytest.importorskip("webdataset")
    urls = [str(p) for p in sorted((root / split).glob("*.tar"))]
    return [(s["__key__"], int(s["cls"])) for s in wds.WebDataset(urls, shardshuffle=False)]


def _keys(paths: list[str]) -> list[str]:
    from webdataset.tariterators import base_plus_ext

    return [base_plus_ext(p.rpartition("::")[2].rsplit(":", 2)[0])[0] for p in paths]


@pytest.mark.e2e  # starts worker or store-helper processes
@pytest.mark.parametrize("backend", BACKENDS)
def test_keys_with_folders_and_dots_are_the_samples_webdataset_reads(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STALLFREE_CACHE", str(tmp_path / "cache"))
    _real_world_shards(tmp_path / "wds")
    expected = _webdataset_reads(tmp_path / "wds", "val")
    assert [key for key, _ in expected] == [key for key, _ in _KEYS]  # 6 samples
    dataset = resolve_dataset(DataConfig(root=str(tmp_path / "wds"), format="tar"))
    for split in ("train", "val"):
        listing = dataset.splits[split]
        got = list(zip(_keys(listing.files), listing.labels.tolist(), strict=True))
        assert got == _webdataset_reads(tmp_path / "wds", split)  # same samples, keys, labels
    recipe = small_recipe(
        tmp_path / "wds", data={"format": "tar"}, loader={"backend": backend}, train={"batch_size": 4}
    )
    loader = build_loader(recipe, "val", device=CPU)
    labels = [label for batch in loader for label in batch.labels.tolist()]
    loader.close()
    assert labels == [label for _, label in expected]
    report = check_dataset(tmp_path / "wds", workers=1, progress=False)
    assert len(report.good) == 12 and not report.bad  # data check counts them all
