"""`stallfree data check`: every odd file classified, and the clean list both loaders accept."""

from __future__ import annotations

import io
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import PYTHON, build_loader, small_recipe
from PIL import Image

from stallfree.cli import main
from stallfree.data.readers.imageio import BadImageError
from stallfree.data.tools.check import check_dataset
from stallfree.data.tools.pack import pack_dataset


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


def _write(root: Path) -> dict[str, str]:
    expected = {}
    for split in ("train", "val"):
        folder = root / split / "a"
        folder.mkdir(parents=True)
        for k in range(3):
            (folder / f"ok{k}.jpg").write_bytes(_jpeg())
    for name, (content, kind) in _odd_files().items():
        path = root / "train" / "a" / name
        if isinstance(content, Image.Image):
            content.save(path)
        else:
            path.write_bytes(content)
        expected[f"train/a/{name}"] = kind
    return expected


@pytest.mark.e2e  # starts worker or store-helper processes
def test_every_odd_file_is_classified_and_the_clean_list_excludes_exactly_them(tmp_path: Path) -> None:
    expected = _write(tmp_path)
    report = check_dataset(tmp_path, workers=2, progress=False)
    from stallfree.data.tools.check import kind_of

    found = {str(p.relative_to(tmp_path)): kind_of(reason) for p, reason in report.bad}
    assert found == {name: kind for name, kind in expected.items() if kind}
    listed = {line for line in report.clean_list().splitlines() if not line.startswith("#")}
    assert listed == {str(p.relative_to(tmp_path)) for p in report.good}
    assert "train/a/grey16.png" in listed and "train/a/bomb.jpg" not in listed


@pytest.mark.e2e  # starts worker or store-helper processes
@pytest.mark.parametrize("backend", ["torch", pytest.param("dali", marks=pytest.mark.dali)])
def test_the_clean_list_trains_under_both_loaders(
    tmp_path: Path, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _write(tmp_path / "data")
    clean = tmp_path / "clean.txt"
    assert (
        main(
            [
                "data",
                "check",
                str(tmp_path / "data"),
                "--workers",
                "1",
                "--no-progress",
                "--write-list",
                str(clean),
            ]
        )
        == 1
    )  # bad files exist: exit 1
    out = capsys.readouterr().out
    assert "BAD" in out and "truncated: 1" in out and "over the pixel limit: 1" in out
    recipe = small_recipe(
        tmp_path / "data",
        data={"file_list": str(clean)},
        loader={"backend": backend},
        train={"batch_size": 2},
    )
    loader = build_loader(recipe, "train", device=torch.device("cpu"))
    assert sum(b.labels.numel() for b in loader) == 6  # 3 ok + cmyk, grey16, palette, good: 7 -> 3 x 2
    loader.close()
    assert main(["data", "check", str(tmp_path / "data"), "--workers", "1", "--no-progress"]) == 1


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


@pytest.mark.e2e
def test_skip_is_counted_in_metrics(tmp_path: Path) -> None:
    import json

    from stallfree.train.run import train

    _root_with_bad_train_files(tmp_path / "data")
    recipe = small_recipe(tmp_path / "data", data={"on_error": "skip"}, train={"batch_size": 4, "epochs": 2})
    with pytest.warns(UserWarning):
        train(recipe, tmp_path / "run", progress=False)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_samples"] for r in records if "loss" in r][-1] == 4  # 2 a pass, 2 epochs


@pytest.mark.e2e  # starts worker or store-helper processes
@pytest.mark.dali
def test_skip_on_dali_reads_a_checked_list_and_caches_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stallfree.data.readers.startup_check as startup

    monkeypatch.setenv("STALLFREE_CACHE", str(tmp_path / "cache"))
    _root_with_bad_train_files(tmp_path / "data")
    recipe = small_recipe(
        tmp_path / "data", data={"on_error": "skip"}, loader={"backend": "dali"}, train={"batch_size": 2}
    )
    with pytest.warns(UserWarning, match="2 file.*left out"):
        loader = build_loader(recipe, "train", device=torch.device("cpu"))
    assert len(loader) == 5 and sum(b.labels.numel() for b in loader) == 10
    assert loader.skipped_samples == 2  # the left-out files count, once per epoch
    loader.close()
    assert len(list((tmp_path / "cache").glob("decode-*.json"))) == 1
    monkeypatch.setattr(startup, "decode_all", None)  # a second start must not decode again
    with pytest.warns(UserWarning, match="2 file.*left out"):
        again = build_loader(recipe, "train", device=torch.device("cpu"))
    assert len(again) == 5
    again.close()


@pytest.mark.e2e
def test_a_killed_pack_leaves_a_staging_folder_that_check_names_and_pack_removes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 24 (13): `data pack` killed (SIGKILL) after its first split leaves its staging
    folder beside OUT; `data check OUT` names it, and the next `data pack` removes it."""
    import subprocess

    root = tmp_path / "data"
    for split, n in (("train", 4), ("val", 2)):
        (root / split / "a").mkdir(parents=True)
        for k in range(n):
            (root / split / "a" / f"{k}.jpg").write_bytes(_jpeg())
    out = tmp_path / "shards"
    script = (
        "import os, signal\nimport stallfree.data.tools.pack as p\nwrite = p.pack_split\n"
        "def killed(*args, **kwargs):\n    write(*args, **kwargs)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "p.pack_split = killed\n"
        f"p.pack_dataset({str(root)!r}, {str(out)!r}, shard_bytes=1 << 20, progress=False)\n"
    )
    done = subprocess.run([PYTHON, "-c", script], capture_output=True, timeout=120)
    assert done.returncode == -9
    left = list(tmp_path.glob(".shards.packing-*"))
    assert len(left) == 1 and not out.exists()
    assert main(["data", "check", str(out), "--workers", "1", "--no-progress"]) != 0
    err = capsys.readouterr().err
    assert left[0].name in err and "data pack" in err and "\n" not in err.strip()
    with pytest.warns(UserWarning, match=r"removed .*\.shards\.packing-.*interrupted"):
        assert main(["data", "pack", str(root), str(out), "--no-progress"]) == 0
    assert not list(tmp_path.glob(".shards.packing-*")) and (out / "manifest.json").is_file()


def _foreign_shards(root: Path) -> Path:
    """Other people's shards: ROOT/{train,val}/shard-N.tar, 4 samples each (KEY.jpg + KEY.cls)."""
    for split, count in (("train", 3), ("val", 1)):
        (root / split).mkdir(parents=True)
        for part in range(count):
            with tarfile.open(root / split / f"shard-{part}.tar", "w") as tar:
                for i in range(4):
                    for name, data in (
                        (f"s{part}_{i}.jpg", _jpeg()),
                        (f"s{part}_{i}.cls", str(i % 2).encode()),
                    ):
                        info = tarfile.TarInfo(name)
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
    return root


@pytest.mark.e2e  # starts worker processes
@pytest.mark.parametrize("kind", ["packed", "foreign"])
def test_a_truncated_shard_is_named_once_and_the_other_shards_samples_are_checked(
    image_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """One truncated shard of several: it counted "0 good, 2 bad files" (the root named as
    the bad one, the shard's checksum as the other), no sample of the whole shards checked."""
    root = tmp_path / "root"
    if kind == "packed":
        pack_dataset(image_root, root, shard_bytes=200_000, progress=False)
    else:
        _foreign_shards(root)
    shards = sorted(root.rglob("*.tar"))
    victim = next(s for s in shards if "train" in s.relative_to(root).as_posix() and s != shards[0])

    def samples(shard: Path) -> int:
        with tarfile.open(shard) as tar:
            return sum(m.name.endswith(".cls") for m in tar)

    total, lost = sum(map(samples, shards)), samples(victim)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    assert main(["data", "check", str(root), "--workers", "1", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert (
        [line for line in out.splitlines() if line.startswith("BAD ")]
        == [line for line in out.splitlines() if line.startswith(f"BAD {victim}:")]  # or `::member`
        != []
    ), out
    assert f"{total - lost} good, 0 bad samples in {root} " in out, out
    assert f"shards: {len(shards) - 1} good, 1 bad" in out, out
