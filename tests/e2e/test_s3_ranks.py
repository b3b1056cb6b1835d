"""Runs (one rank, and two under torchrun, gloo, CPU) reading from a real S3-compatible server:
the same weights as the same ranks reading a local copy, through a SIGTERM and `--resume auto`;
a store that stays down ends every rank (none waits forever in a collective) with the object
and the reason."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import PYTHON, final_weights, small_recipe, torchrun_train
from s3_server import Server, need_weed, upload_tree

from stallfree.cli import main
from stallfree.data import storage
from stallfree.recipe import Recipe, dump_toml
from stallfree.train.checkpoint import load_checkpoint

pytestmark = pytest.mark.slow


def _recipe(root: str | Path, backend: str = "torch", fmt: str = "folder", epochs: int = 2) -> Recipe:
    # 60 images, 4 a rank: 7 steps an epoch; one record a step.
    return small_recipe(
        root,
        data={"format": fmt},
        loader={"backend": backend, "torch": {"workers": 1}, "dali": {"threads": 1}},
        train={"epochs": epochs, "batch_size": 4},
        optim={"name": "sgd", "lr": 0.05},
    )


def _launch(recipe: Recipe, run: Path, *extra: str, ranks: int = 2) -> subprocess.Popen[str]:
    path = run.parent / f"{run.name}.toml"
    path.write_text(dump_toml(recipe))
    one = [PYTHON, "-m", "stallfree", "train", str(path), "--out", str(run), *extra, "--no-progress"]
    return subprocess.Popen(
        torchrun_train(str(path), "--out", str(run), *extra) if ranks > 1 else one,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group: signalled as a scheduler does, torchrun and all
    )


def _wait_for_records(proc: subprocess.Popen[str], run: Path, records: int) -> None:
    metrics, deadline = run / "metrics.jsonl", time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= records:
            return
        time.sleep(0.05)
    raise AssertionError(proc.communicate()[1][-3000:])


def _finish(proc: subprocess.Popen[str], timeout: float = 300) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, err


def _train_records(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if "loss" in record]


@pytest.fixture(scope="module")
def packed(image_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ranks-packed")
    assert main(["data", "pack", str(image_root), str(out), "--shard-size", "200KB", "--no-progress"]) == 0
    return out


# torch on folders at 1 rank, DALI on stallfree's shards (ranged reads by the index) at 2
# under torchrun: each layout, each loader and each launch through a SIGTERM and `--resume
# auto` at least once. (torch on folders at 2 ranks from the store: the stays-down test below;
# a third torchrun case cost the suite ~35 s of its 5 minutes.)
CASES = [("torch", "folder", 1), pytest.param("dali", "tar", 2, marks=pytest.mark.dali)]


@pytest.mark.parametrize(("backend", "fmt", "ranks"), CASES)
def test_a_run_from_the_store_through_a_sigterm_is_the_run_from_a_local_copy(
    s3_server, image_root: Path, packed: Path, tmp_path: Path, backend: str, fmt: str, ranks: int
) -> None:
    local = image_root if fmt == "folder" else packed
    local_run = tmp_path / "local"
    # One epoch: the stop is asserted mid-epoch 0 below either way; a second only costs time.
    code, err = _finish(_launch(_recipe(local, backend, fmt, epochs=1), local_run, ranks=ranks))
    assert code == 0, err[-3000:]
    url = upload_tree(s3_server.client(), local, "ranks", fmt)
    run = tmp_path / "s3"
    proc = _launch(_recipe(url, backend, fmt, epochs=1), run, ranks=ranks)
    _wait_for_records(proc, run, records=1)
    os.killpg(proc.pid, signal.SIGTERM)
    code, err = _finish(proc)
    assert code != 0, err[-3000:]  # torchrun reports a failure: preempted.json says what it was
    stopped = load_checkpoint(Path(json.loads((run / "preempted.json").read_text())["checkpoint"]))
    steps = 60 // (4 * ranks)  # 60 images, 4 a rank
    assert (
        stopped["world_size"] == ranks and 0 < stopped["counters"]["optimizer_steps"] < steps
    )  # mid-epoch 0
    code, err = _finish(_launch(_recipe(url, backend, fmt, epochs=1), run, "--resume", "auto", ranks=ranks))
    assert code == 0, err[-3000:]
    expected = final_weights(local_run)
    for name, tensor in final_weights(run).items():
        assert torch.equal(tensor, expected[name]), name
    # Both ranks' counts, summed, in every record: nothing was retried on a clean run.
    assert {record["store_retries"] for record in _train_records(run)} == {0}
    assert "store_retries" not in _train_records(local_run)[0]  # a local root: no such field


def test_a_store_that_stays_down_ends_both_ranks(
    image_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = Server(need_weed(), tmp_path / "weed")
    server.start()
    try:
        for key, value in {**server.env(), storage.OUTAGE_ENV: "2", storage.ATTEMPTS_ENV: "2"}.items():
            monkeypatch.setenv(key, value)
        url = upload_tree(server.client(), image_root, "down", "data")
        run = tmp_path / "run"
        # Epochs to spare: on a busy machine 2 epochs could end before this test saw its records.
        proc = _launch(_recipe(url, epochs=50), run)
        _wait_for_records(proc, run, records=2)
        server.kill()  # and reaped
        with socket.socket() as probe:  # gone, not answering from another process's start
            assert probe.connect_ex(("127.0.0.1", server.ports["s3"])) != 0, server.ports
        code, err = _finish(proc, timeout=120)  # a rank left waiting would fail the test here
    finally:
        server.kill()
    assert code != 0, err[-3000:]
    # Every rank's error line (not a warning quoting the client). A rank whose peer ended first
    # may meet it in a collective: its line names that rank and its error.
    errors = [line for line in err.splitlines() if re.search(r"stallfree: (\[rank \d+\] )?error: ", line)]
    assert errors and all(f"{url}/" in line and "(still after 2 s)" in line for line in errors), err
    assert all("--resume auto continues from the last saved one" in line for line in errors)
