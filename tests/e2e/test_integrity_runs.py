"""Defects a new-user audit found, each with the behaviour it checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import PYTHON, build_loader, exif_block, jpeg_with_segments, small_recipe
from inprocess import Cli
from PIL import Image
from test_integrity import CPU, _root

from stallfree.data.readers.imageio import BadImageError
from stallfree.recipe import dump_toml
from stallfree.train.run import train

BACKENDS = ["torch", pytest.param("dali", marks=pytest.mark.dali)]


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:300])


@pytest.mark.e2e
def test_a_loader_left_open_does_not_hang_the_exit(tmp_path: Path) -> None:
    from stallfree.data.tools.demo import write_demo

    root = write_demo(tmp_path / "data", train_per_class=2, val_per_class=3, seed=1, progress=False)
    victim = sorted((root / "val").rglob("*.jpg"))[4]
    victim.write_bytes(victim.read_bytes()[:3000])  # the header is fine: it fails when decoded
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        dump_toml(small_recipe(root, loader={"torch": {"workers": 2}}, train={"batch_size": 2}))
    )
    script = (
        "import stallfree\n"
        f"loader = stallfree.loader({str(recipe)!r}, 'val', device='cpu')\n"
        "list(loader)  # raises BadImageError, and the loader is never closed\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )  # hung for ever before
    assert done.returncode == 1 and "BadImageError" in done.stderr and victim.name in done.stderr


@pytest.mark.e2e
def test_skip_survives_a_micro_batch_of_only_bad_files(tmp_path: Path) -> None:
    root = _root(tmp_path / "data")
    for name in ("0.jpg", "1.jpg"):
        _truncate(root / "train" / "a" / name)
    recipe = small_recipe(
        root,
        data={"on_error": "skip"},
        loader={"torch": {"workers": 1}},
        train={"batch_size": 1, "accum_steps": 2, "epochs": 2},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        summary = train(recipe, tmp_path / "run", progress=False)
    # 8 train images, batch 1, windows of 2: 4 optimizer steps an epoch, bad batches or not.
    assert summary["optimizer_steps"] == 8
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_samples"] for r in records if "loss" in r][-1] == 4  # 2 a pass, 2 passes


@pytest.mark.e2e  # starts worker or store-helper processes
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dangling_symlink_is_named_not_dropped(tmp_path: Path, backend: str, cli: Cli) -> None:
    root = _root(tmp_path / "data")
    os.symlink(tmp_path / "gone.jpg", root / "train" / "b" / "link.jpg")
    done = cli("data", "check", root, "--workers", "1", "--no-progress")
    assert done.code == 1
    assert "link.jpg" in done.out
    recipe = small_recipe(root, loader={"backend": backend}, train={"batch_size": 2})
    with pytest.raises(BadImageError, match=r"link\.jpg"):
        build_loader(recipe, "train", device=CPU)


@pytest.mark.e2e
def test_a_lost_summary_is_rebuilt_from_the_metrics(tmp_path: Path) -> None:
    root = _root(tmp_path / "data")
    recipe = small_recipe(root, train={"batch_size": 2, "epochs": 2, "log_every": 1})
    first = train(recipe, tmp_path / "run", progress=False)
    (tmp_path / "run" / "summary.json").unlink()  # killed after its last checkpoint
    again = train(recipe, tmp_path / "run", progress=False, resume="auto")
    for key in ("val_top1", "val_top5", "optimizer_steps"):
        assert again[key] == first[key], key
    # The same intervals, re-added: throughput and data-wait as the run measured them.
    assert again["images_per_s"] == pytest.approx(first["images_per_s"], rel=0.02)
    assert (tmp_path / "run" / "summary.json").is_file()


@pytest.mark.e2e
def test_resuming_a_finished_run_with_another_recipe_says_it_had_finished(tmp_path: Path) -> None:
    from stallfree.train.resume import ResumeError

    root = _root(tmp_path / "data")
    train(small_recipe(root, train={"batch_size": 2}), tmp_path / "run", progress=False)
    other = small_recipe(root, train={"batch_size": 4, "epochs": 3})
    with pytest.raises(ResumeError, match="had already finished"):
        train(other, tmp_path / "run", progress=False, resume="auto")


@pytest.mark.e2e
def test_eval_takes_a_run_directory_or_latest(tmp_path: Path, cli: Cli) -> None:
    root = _root(tmp_path / "data")
    recipe = small_recipe(root, train={"batch_size": 2})
    train(recipe, tmp_path / "run", progress=False)
    path = tmp_path / "r.toml"
    path.write_text(dump_toml(recipe))
    results = []
    for given in (tmp_path / "run", tmp_path / "run" / "checkpoints" / "latest"):
        done = cli("eval", path, "--checkpoint", given, "--json")
        assert done.code == 0
        results.append(json.loads(done.out.strip().splitlines()[-1]))
    # The run directory reads best.pt, `latest` the newest checkpoint: one epoch, the same weights.
    assert [r.pop("checkpoint").rsplit("/", 1)[-1] for r in results] == ["best.pt", "ckpt-000000004.pt"]
    assert results[0] == results[1] and results[0]["samples"] == 8


@pytest.mark.e2e  # starts worker or store-helper processes
@pytest.mark.dali
def test_corrupt_entropy_data_data_check_is_the_arbiter(tmp_path: Path, cli: Cli) -> None:
    """2,000 bytes flipped mid-file: PIL (torch, data check) refuses the file, DALI's decoder
    decodes it into partly garbled pixels. The documented rule: `data check` decides, and its
    clean list makes both loaders train on the same files."""
    from stallfree.data.backends.dali_backend import first_undecodable
    from stallfree.data.readers.imageio import open_rgb

    root = _root(tmp_path / "data")
    victim = root / "train" / "a" / "2.jpg"
    noise = torch.randint(0, 255, (375, 500, 3), generator=torch.Generator().manual_seed(0))
    Image.fromarray(noise.cumsum(1).remainder(255).to(torch.uint8).numpy()).save(victim, quality=90)
    data = bytearray(victim.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 2000):
        data[i] ^= 0x5A
    victim.write_bytes(bytes(data))
    with pytest.raises(BadImageError, match="broken data stream"):
        open_rgb(str(victim))
    assert first_undecodable([str(victim)]) is None  # DALI decodes it: the documented difference
    clean = tmp_path / "clean.txt"
    done = cli("data", "check", root, "--workers", "1", "--no-progress", "--write-list", clean)
    assert done.code == 1
    assert "2.jpg" in done.out and "train/a/2.jpg" not in clean.read_text()


# Issue 24 (1, 2): files DALI's decoder cannot take (a native crash, or a stop naming no file)
# that PIL decodes. The header check refuses them, so both loaders and `data check` agree.
PILLOW_DATA = Path(__file__).parents[1] / "data" / "pillow"


def _dali_breaker(kind: str, path: Path) -> Path:
    if kind == "two_exif_jpeg":  # DALI reads both blocks: signal 11 / "corrupted double-linked list"
        return jpeg_with_segments(path.with_suffix(".jpg"), [(0xE1, exif_block(6)), (0xE1, exif_block(3))])
    if kind == "truncated_jpeg2000":  # a codestream without its end: DALI segfaults
        target = path.with_suffix(".jp2")
        Image.effect_noise((64, 48), 40).convert("RGB").save(target, "JPEG2000")
        target.write_bytes(target.read_bytes()[:-200])
        return target
    target = path.with_suffix(".tif")  # a fuzzed G4 TIFF without RowsPerStrip: DALI stops
    target.write_bytes((PILLOW_DATA / "crash-74d2a78403a5a59db1fb0a2b8735ac068a75f6e3.tif").read_bytes())
    return target


_BREAKERS = {
    "two_exif_jpeg": "EXIF",
    "tiff_without_rows_per_strip": "RowsPerStrip",
    "truncated_jpeg2000": "truncated JPEG 2000",
}


@pytest.mark.e2e  # starts worker or store-helper processes
@pytest.mark.parametrize("kind", sorted(_BREAKERS))
def test_files_dali_cannot_decode_are_refused_by_the_header_check(
    tmp_path: Path, kind: str, cli: Cli
) -> None:
    from stallfree.data.readers.imageio import check_header

    root = _root(tmp_path / "data")
    victim = _dali_breaker(kind, root / "train" / "a" / "odd")
    if kind != "truncated_jpeg2000":  # PIL decodes it: only the rule keeps it out of torch
        Image.open(victim).convert("RGB")
    with pytest.raises(BadImageError, match=_BREAKERS[kind]) as caught:
        check_header(str(victim))
    assert str(victim) in str(caught.value)
    clean = tmp_path / "clean.txt"
    done = cli("data", "check", root, "--workers", "1", "--no-progress", "--write-list", clean)
    assert done.code == 1
    out = done.out
    assert victim.name in out and _BREAKERS[kind] in out and victim.name not in clean.read_text()


_LOAD_BOTH_POLICIES = """
import sys, warnings, torch
from stallfree.recipe import load_recipe, recipe_from_dict
from stallfree import loader as build_loader
from stallfree.data.readers.imageio import BadImageError
for kind, policy, path in zip(sys.argv[1::3], sys.argv[2::3], sys.argv[3::3]):
    recipe = load_recipe(path)
    for split in ("train", "val"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                loader = build_loader(recipe, split, device="cpu")
                samples = sum(len(batch.labels) for batch in loader)
                loader.close()
            except BadImageError as exc:
                print(kind, policy, split, "refused", exc, flush=True)
                continue
        said = " | ".join(str(w.message) for w in caught if "skip" in str(w.message))
        print(kind, policy, split, "samples", samples, said, flush=True)
"""


@pytest.mark.e2e
@pytest.mark.parametrize("backend", BACKENDS)
def test_both_loaders_refuse_them_at_start_under_raise_and_skip(tmp_path: Path, backend: str) -> None:
    """In a subprocess: DALI's failure on these files was a native crash of the process. One
    process for every kind (a start of torch and DALI is most of its cost); each kind's lines
    name it."""
    victims, args = {}, []
    for kind in sorted(_BREAKERS):
        root = _root(tmp_path / kind)
        victims[kind] = []
        for split in ("train", "val"):
            if kind != "two_exif_jpeg":  # the TIFF or JP2 replaces 0.jpg: 8 files a split
                (root / split / "a" / "0.jpg").unlink()
            victims[kind].append(_dali_breaker(kind, root / split / "a" / "0").name)
        for policy in ("raise", "skip"):
            recipe = tmp_path / f"{kind}-{policy}.toml"
            on_error = {"on_error": policy}
            recipe.write_text(
                dump_toml(
                    small_recipe(root, data=on_error, loader={"backend": backend}, train={"batch_size": 1})
                )
            )
            args += [kind, policy, str(recipe)]
    done = subprocess.run(
        [PYTHON, "-c", _LOAD_BOTH_POLICIES, *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 4 * len(_BREAKERS), done.stdout
    for line in lines:
        kind, policy, _ = line.split(" ", 2)
        if policy == "raise":  # refused at start, the file and the reason named
            assert " refused " in line and _BREAKERS[kind] in line, line
        else:  # left out with a warning naming it, the other 7 read
            assert " samples 7 " in line, line
        assert any(v in line for v in victims[kind]), line
