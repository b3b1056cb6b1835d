"""Tar shards that cannot train on wrong labels: each corruption an interrupted re-pack, an
edited index or a swapped file leaves is one line naming the shard (and member), never a
silent wrong label or a silently shorter epoch. And other people's WebDataset shards."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helpers import PYTHON
from test_tar_integrity import _pack

from stallfree.cli import main


@pytest.fixture()
def packed(image_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("STALLFREE_CACHE", str(tmp_path / "cache"))  # no check remembered
    return _pack(image_root, tmp_path / "packed")


@pytest.mark.e2e
def test_data_check_on_shards_finds_a_changed_shard(packed: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "check", str(packed), "--workers", "1", "--no-progress"]) == 0
    shard = packed / "val-000000.tar"
    data = bytearray(shard.read_bytes())
    data[2000] ^= 0xFF  # one byte inside an image: sizes and indexes stay right
    shard.write_bytes(bytes(data))
    assert main(["data", "check", str(packed), "--workers", "1", "--no-progress"]) == 1
    assert f"BAD {shard}: SHA-256 differs" in capsys.readouterr().out


@pytest.mark.e2e
def test_pack_is_all_or_nothing(image_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("x")
    assert main(["data", "pack", str(image_root), str(tmp_path / "afile"), "--no-progress"]) == 2
    assert "is a file" in capsys.readouterr().err
    full = _pack(image_root, tmp_path / "full")
    assert main(["data", "pack", str(image_root), str(full), "--no-progress"]) == 2
    assert "is not empty" in capsys.readouterr().err
    # Killed mid-pack: nothing at OUT, and no half-written folder left behind.
    out = tmp_path / "killed"
    code = (
        "import sys, stallfree.data.tools.pack as p\n"
        "real = p.pack_split\n"
        "def boom(samples, out, split, *a, **k):\n"
        "    if split == 'val': raise KeyboardInterrupt\n"
        "    return real(samples, out, split, *a, **k)\n"
        "p.pack_split = boom\n"
        f"p.pack_dataset({str(image_root)!r}, {str(out)!r}, shard_bytes=200000, "
        "progress=False)\n"
    )
    subprocess.run([PYTHON, "-c", code], capture_output=True, timeout=120, check=False)
    assert not out.exists() and not list(tmp_path.glob(".killed*"))
