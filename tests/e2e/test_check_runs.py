"""`stallfree data check`: every odd file classified, and the clean list both loaders accept."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
import torch
from helpers import PYTHON, build_loader, small_recipe
from inprocess import Cli
from PIL import Image
from test_check import _jpeg, _odd_files, _root_with_bad_train_files

from stallfree.data.tools.check import check_dataset
from stallfree.data.tools.pack import pack_dataset


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

    found = {str(Path(p).relative_to(tmp_path)): kind_of(reason) for p, reason in report.bad}
    assert found == {name: kind for name, kind in expected.items() if kind}
    listed = {line for line in report.clean_list().splitlines() if not line.startswith("#")}
    assert listed == {str(Path(p).relative_to(tmp_path)) for p in report.good}
    assert "train/a/grey16.png" in listed and "train/a/bomb.jpg" not in listed


@pytest.mark.e2e  # starts worker or store-helper processes
@pytest.mark.parametrize("backend", ["torch", pytest.param("dali", marks=pytest.mark.dali)])
def test_the_clean_list_trains_under_both_loaders(tmp_path: Path, backend: str, cli: Cli) -> None:
    _write(tmp_path / "data")
    clean = tmp_path / "clean.txt"
    done = cli("data", "check", tmp_path / "data", "--workers", "1", "--no-progress", "--write-list", clean)
    assert done.code == 1  # bad files exist: exit 1
    out = done.out
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
    assert cli("data", "check", tmp_path / "data", "--workers", "1", "--no-progress").code == 1


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
    tmp_path: Path, cli: Cli
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
    done = cli("data", "check", out, "--workers", "1", "--no-progress")
    assert done.code != 0
    err = done.err
    assert left[0].name in err and "data pack" in err and "\n" not in err.strip()
    with pytest.warns(UserWarning, match=r"removed .*\.shards\.packing-.*interrupted"):
        assert cli("data", "pack", root, out, "--no-progress").code == 0
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
    image_root: Path, tmp_path: Path, cli: Cli, kind: str
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
    done = cli("data", "check", root, "--workers", "1", "--no-progress")
    assert done.code == 1
    out = done.out
    assert (
        [line for line in out.splitlines() if line.startswith("BAD ")]
        == [line for line in out.splitlines() if line.startswith(f"BAD {victim}:")]  # or `::member`
        != []
    ), out
    assert f"{total - lost} good, 0 bad samples in {root} " in out, out
    assert f"shards: {len(shards) - 1} good, 1 bad" in out, out
