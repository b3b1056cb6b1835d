"""What a batch job on a cluster meets: start-up that does not grow on every requeue, logs in a
file, a requeue loop that cannot spin, and warnings that are not lost."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from helpers import PYTHON, build_loader, small_recipe, torchrun_train

import stallfree.data.readers.startup_check as startup
from stallfree.data.readers.check_pool import check_headers
from stallfree.data.readers.imageio import BadImageError, bad_headers
from stallfree.recipe import dump_toml
from stallfree.train.run import train

pytestmark = pytest.mark.e2e  # every test here trains a run or starts a process

CPU = torch.device("cpu")
STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d stallfree: ")


def _copy_root(src: Path, dst: Path) -> Path:
    """A private copy (hard links) of the shared demo data, so the test may change it."""
    for path in src.rglob("*"):
        target = dst / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif path.suffix == ".jpg":
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, target)
    return dst


def _fail(*_: object, **__: object) -> None:
    raise AssertionError("headers were checked again")


def test_the_header_check_runs_once_per_dataset_state(
    image_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _copy_root(image_root, tmp_path / "data")
    monkeypatch.setenv("STALLFREE_CACHE", str(tmp_path / "cache"))
    recipe = small_recipe(root, train={"batch_size": 4})
    build_loader(recipe, "train", device=CPU).close()
    assert len(list((tmp_path / "cache").glob("headers-*.json"))) == 1
    monkeypatch.setattr(startup, "check_headers", _fail)
    build_loader(recipe, "train", device=CPU).close()  # a requeue: the same data, no check
    # A file added (its folder's time changes): checked again, and the bad one is named.
    (root / "train" / sorted(os.listdir(root / "train"))[0] / "new.jpg").write_bytes(b"junk")
    monkeypatch.setattr(startup, "check_headers", check_headers)
    with pytest.raises(BadImageError, match=r"new\.jpg"):
        build_loader(recipe, "train", device=CPU)
    monkeypatch.setattr(startup, "check_headers", _fail)
    with pytest.raises(BadImageError, match=r"new\.jpg"):  # cached bad files still stop a run
        build_loader(recipe, "train", device=CPU)


def test_a_data_check_list_needs_no_header_check(
    image_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stallfree.cli import main

    clean = tmp_path / "clean.txt"
    assert (
        main(
            ["data", "check", str(image_root), "--workers", "1", "--no-progress", "--write-list", str(clean)]
        )
        == 0
    )
    monkeypatch.setenv("STALLFREE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(startup, "check_headers", _fail)
    recipe = small_recipe(image_root, data={"file_list": str(clean)}, train={"batch_size": 4})
    loader = build_loader(recipe, "train", device=CPU)
    assert sum(b.labels.numel() for b in loader) == 60  # every listed image, unchecked
    loader.close()
    # Another pixel limit than the list was checked under: checked at start after all.
    other = small_recipe(
        image_root, data={"file_list": str(clean), "max_pixels": 10**7}, train={"batch_size": 4}
    )
    with pytest.raises(AssertionError, match="checked again"):
        build_loader(other, "train", device=CPU)


def test_a_finished_run_exits_before_listing_anything(
    image_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stallfree.train.prepare as build_module

    recipe = small_recipe(image_root, train={"batch_size": 8})
    first = train(recipe, tmp_path / "run", progress=False)

    def no_listing(*_: object) -> None:
        raise AssertionError("listed the data of a finished run")

    monkeypatch.setattr(build_module, "resolve_dataset", no_listing)
    again = train(recipe, tmp_path / "run", progress=False, resume="auto")
    assert again == first


def test_the_requeue_loop_stops_on_a_failing_start(image_root: Path, tmp_path: Path) -> None:
    """The README's loop around a run whose directory holds a stale marker from an earlier
    preemption: the start fails its checks (exit 2), and the loop must not go round again."""
    recipe = tmp_path / "r.toml"
    recipe.write_text(dump_toml(small_recipe(image_root, train={"batch_size": 1000})))
    run = tmp_path / "run"
    run.mkdir()
    (run / "preempted.json").write_text('{"signal": "SIGTERM"}')
    loop = (
        f"n=0; until n=$((n+1)); [ $n -le 3 ] || exit 99; {PYTHON} -m stallfree "
        f"train {recipe} --out {run} --resume auto --no-progress; do code=$?; "
        f'[ "$code" -eq 75 ] || [ -f {run}/preempted.json ] || exit "$code"; done'
    )
    done = subprocess.run(["bash", "-c", loop], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]  # once, with the start's own error
    assert done.stderr.count("stallfree: error:") == 1
    assert not (run / "preempted.json").exists()


def test_a_log_file_under_torchrun_reads_as_plain_lines_each_once(image_root: Path, tmp_path: Path) -> None:
    recipe = small_recipe(
        image_root,
        optim={"warmup_steps": 1000},  # warns: past the run
        train={"epochs": 2, "batch_size": 4, "log_every": 2},
    )
    path = tmp_path / "r.toml"
    path.write_text(dump_toml(recipe))
    log = tmp_path / "log"
    command = (
        f"{PYTHON} -m torch.distributed.run --nproc_per_node 2 --standalone "
        f"-m stallfree train {path} --out {tmp_path / 'run'} > {log} 2>&1"
    )
    done = subprocess.run(["bash", "-c", command], timeout=300, check=False)
    text = log.read_text()
    assert done.returncode == 0, text[-3000:]
    assert "\r" not in text  # no progress-bar frames off a terminal
    ours = [line for line in text.splitlines() if "stallfree: " in line]
    assert ours and all(STAMP.match(line) for line in ours), ours
    bodies = collections.Counter(STAMP.sub("", line) for line in ours)
    assert max(bodies.values()) == 1, bodies.most_common(3)  # each line once, not once a rank
    assert sum("warmup_steps" in body for body in bodies) == 1
    assert sum(body.startswith("epoch ") and "val top-1" in body for body in bodies) == 2
    assert sum(body.startswith("step ") and "img/s" in body for body in bodies) >= 2
    assert text.count("images_per_s=") == 1  # the summary on stdout, from rank 0 only
    assert "[rank 1]" not in text


def test_a_recipe_error_under_torchrun_is_said_once(image_root: Path, tmp_path: Path) -> None:
    """Every rank meets a bad key alike; the node's first rank says it, the others exit
    without a word."""
    path = tmp_path / "r.toml"
    path.write_text(dump_toml(small_recipe(image_root)))
    done = subprocess.run(
        torchrun_train(str(path), "--out", str(tmp_path / "run"), "--set", "train.batch_size=abc"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [line for line in done.stderr.splitlines() if "stallfree" in line and "error:" in line]
    assert done.returncode != 0 and len(errors) == 1, done.stderr[-3000:]
    assert "train.batch_size" in errors[0] and "[rank 1]" not in errors[0]


def test_a_rank_whose_peer_ended_first_says_so_in_one_line(image_root: Path, tmp_path: Path) -> None:
    """Rank 1 meets a data error at its third batch while rank 0 goes into that step's
    collectives: rank 1 says its error, and rank 0, whose collective fails when rank 1's
    connection closes, says in one line which rank ended first and why, not gloo's traceback."""
    path = tmp_path / "r.toml"
    path.write_text(
        dump_toml(small_recipe(image_root, loader={"backend": "failing_loader:build"}, train={"epochs": 2}))
    )
    tests = str(Path(__file__).parents[1])
    env = {
        **os.environ,
        "STALLFREE_FAILING_RANK": "1",
        "PYTHONPATH": tests + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    done = subprocess.run(
        torchrun_train(str(path), "--out", str(tmp_path / "run")),
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    errors = [
        line for line in done.stderr.splitlines() if re.search(r"stallfree: (\[rank \d+\] )?error: ", line)
    ]
    assert done.returncode != 0, done.stderr[-3000:]
    assert "Connection closed by peer" not in done.stderr and "[rank0]: Traceback" not in done.stderr, (
        done.stderr[-3000:]
    )
    mine = [line for line in errors if "[rank 1]" in line]
    assert len(mine) == 1 and "broken.jpg: not an image" in mine[0], done.stderr[-3000:]
    # torchrun may stop rank 0 (SIGTERM) before its collective fails: then it says nothing.
    peer = [line for line in errors if "[rank 1]" not in line]
    assert len(peer) <= 1 and all("rank 1 ended first" in line and "broken.jpg" in line for line in peer), (
        done.stderr[-3000:]
    )


def test_concurrent_header_checks_leave_the_warning_filters_alone(image_root: Path) -> None:
    paths = [str(p) for p in sorted(image_root.rglob("*.jpg"))] * 4
    for _ in range(20):
        before = list(warnings.filters)
        assert bad_headers(paths, threads=2) == []
        assert warnings.filters == before


def test_a_stop_signal_during_start_up_is_kept_for_the_first_step() -> None:
    import signal

    from stallfree.train.signals import StopSignal

    previous = signal.getsignal(signal.SIGUSR1)
    with StopSignal((signal.SIGUSR1,)) as outer:  # what `stallfree train` holds from its start
        signal.raise_signal(signal.SIGUSR1)  # while the run lists and checks its data
        assert outer.requested == "SIGUSR1"
        with StopSignal() as inner:  # the training loop's own handler
            assert inner.requested == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) == previous


def _truncated_jpeg() -> bytes:
    """A JPEG cut short: its header passes the start-up check, its decode fails."""
    import io

    import numpy as np
    from PIL import Image

    buffer = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 255, (200, 300, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()[:1500]


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid` and its descendants (torchrun starts its workers in their own sessions,
    so a process group does not reach them)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        children[int(fields[1])].append(int(stat.parent.name))
    todo, found = [pid], []
    while todo:
        found.append(todo.pop())
        todo += children[found[-1]]
    for victim in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)


def test_ddp_does_not_hang_when_one_rank_logs_an_all_skipped_window(image_root: Path, tmp_path: Path) -> None:
    """Rank 0's first micro-batch is all bad files, rank 1's is clean, a record every step:
    both ranks must run the same collectives (the skipped-count sum) whatever their data."""
    from stallfree.data.readers.factory import resolve_dataset
    from stallfree.data.sharding import ShardPlan, epoch_permutation

    root = _copy_root(image_root, tmp_path / "data")
    recipe = small_recipe(
        root, data={"on_error": "skip"}, train={"batch_size": 4, "log_every": 1, "epochs": 1}
    )
    listing = resolve_dataset(recipe.data).splits["train"]
    order, _ = epoch_permutation(len(listing), seed=recipe.train.seed, epoch=0, shuffle=True)
    first = next(iter(ShardPlan(len(listing), 4, rank=0, world_size=2).batches(order, 0)))
    for path in listing.paths(first.tolist()):
        Path(path).unlink()  # a hard link to the shared data: replace it, do not write through
        Path(path).write_bytes(_truncated_jpeg())
    path = tmp_path / "r.toml"
    path.write_text(dump_toml(recipe))
    run = tmp_path / "run"
    log = tmp_path / "log"
    with log.open("w") as out:  # a file, not a pipe: a stuck rank would hold a pipe open
        proc = subprocess.Popen(
            torchrun_train(str(path), "--out", str(run)),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        proc.wait(timeout=90)  # a clean run takes well under a minute on 2 busy cores
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)  # torchrun and both ranks (each in its own session)
        pytest.fail("the ranks hung: " + log.read_text()[-2000:])
    assert proc.returncode == 0, log.read_text()[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_samples"] for r in records if "loss" in r][-1] == 4
