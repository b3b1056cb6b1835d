"""Tar shards that cannot train on wrong labels: each corruption an interrupted re-pack, an
edited index or a swapped file leaves is one line naming the shard (and member), never a
silent wrong label or a silently shorter epoch. And other people's WebDataset shards."""

from __future__ import annotations

from pathlib import Path

import pytest
from inprocess import Cli
from test_tar_integrity import _pack


@pytest.fixture()
def packed(image_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("STALLFREE_CACHE", str(tmp_path / "cache"))  # no check remembered
    return _pack(image_root, tmp_path / "packed")


@pytest.mark.e2e
def test_data_check_on_shards_finds_a_changed_shard(packed: Path, cli: Cli) -> None:
    assert cli("data", "check", packed, "--workers", "1", "--no-progress").code == 0
    shard = packed / "val-000000.tar"
    data = bytearray(shard.read_bytes())
    data[2000] ^= 0xFF  # one byte inside an image: sizes and indexes stay right
    shard.write_bytes(bytes(data))
    done = cli("data", "check", packed, "--workers", "1", "--no-progress")
    assert done.code == 1
    assert f"BAD {shard}: SHA-256 differs" in done.out
