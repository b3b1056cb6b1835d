"""Faults of a real S3-compatible server (SeaweedFS on loopback) during a run: a store that
restarts mid-epoch costs time, not the run; one that stays down ends it in one line."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from helpers import small_recipe, train_until_logged
from s3_server import Server, need_weed, upload_tree

from stallfree.data.readers import store
from stallfree.train.checkpoint import load_checkpoint
from stallfree.train.run import train

pytestmark = pytest.mark.slow


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A server of this test's own, to kill; the run's subprocess finds it by the environment."""
    own = Server(need_weed(), tmp_path / "weed")
    own.start()
    for key, value in own.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(store, "_clients", {})
    yield own
    own.kill()


def _recipe(root: str | Path):
    return small_recipe(
        root,
        loader={"backend": "torch", "torch": {"workers": 1}},
        train={"epochs": 2, "batch_size": 4},
        optim={"name": "sgd", "lr": 0.05},
    )


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(sorted((run / "checkpoints").glob("ckpt-*.pt"))[-1])["model"]


def test_a_store_restarted_mid_epoch_does_not_stop_the_run(
    server: Server, image_root: Path, tmp_path: Path
) -> None:
    url = upload_tree(server.client(), image_root, "faults", "data")
    proc, _, run = train_until_logged(_recipe(url), tmp_path, records=2)
    assert proc.poll() is None, proc.communicate()[1]
    server.kill()
    time.sleep(4)
    assert proc.poll() is None  # the run waits for its next batch's files
    server.start()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    train(_recipe(image_root), tmp_path / "local", progress=False)
    local = _final_weights(tmp_path / "local")
    for name, tensor in _final_weights(run).items():
        assert torch.equal(tensor, local[name]), name


def test_a_store_that_stays_down_ends_the_run_in_one_line(
    server: Server, image_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(store.OUTAGE_ENV, "3")
    monkeypatch.setenv(store.ATTEMPTS_ENV, "2")  # botocore's own retries: the outage budget is what is tested
    url = upload_tree(server.client(), image_root, "faults", "data")
    proc, _, _ = train_until_logged(_recipe(url), tmp_path, records=2)
    server.kill()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    errors = [line for line in err.splitlines() if "stallfree: error:" in line]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert f"{url}/" in errors[0] and "Could not connect to the endpoint" in errors[0], errors
    assert "(still after 3 s)" in errors[0], errors
