"""train.trackers: MLflow (a local store) and Weights & Biases (offline) beside metrics.jsonl."""

from __future__ import annotations

import importlib.util
import json
import logging
import signal
import sys
from pathlib import Path

import pytest
from helpers import small_recipe, train_until_logged

from stallfree.metrics import SinkSet
from stallfree.recipe import RecipeError
from stallfree.train.run import train

pytestmark = pytest.mark.e2e  # every test here trains a run or starts a process


def test_mlflow_and_wandb_record_the_run(image_root: Path, tmp_path: Path) -> None:
    pytest.importorskip("mlflow", reason="the track extra: pip install -e '.[track]'")
    pytest.importorskip("wandb", reason="the track extra: pip install -e '.[track]'")
    from mlflow.tracking import MlflowClient

    run = tmp_path / "run"
    recipe = small_recipe(image_root, train={"epochs": 2, "trackers": ["mlflow", "wandb"]})
    summary = train(recipe, run, progress=False)
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    (found,) = client.search_runs([client.get_experiment_by_name("stallfree").experiment_id])
    assert found.info.status == "FINISHED" and found.info.run_name == "run"
    assert found.data.params["train.epochs"] == "2"
    history = client.get_metric_history(found.info.run_id, "val_top1")
    assert [m.step for m in history] == [7, 14]
    assert history[-1].value == pytest.approx(summary["val_top1"])
    assert len(client.get_metric_history(found.info.run_id, "loss")) == 14
    offline = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 1 and offline[0].stat().st_size > 0


@pytest.mark.slow  # ~15 s: a stopped subprocess and a resumed run
def test_a_resumed_run_continues_its_one_mlflow_run(image_root: Path, tmp_path: Path) -> None:
    """Stopped by SIGTERM, then its newest checkpoint lost (a crash after more steps were logged),
    resumed: one MLflow run, every step once, the values of an unbroken history."""
    pytest.importorskip("mlflow", reason="the track extra: pip install -e '.[track]'")
    from mlflow.tracking import MlflowClient

    recipe = small_recipe(
        image_root,
        train={
            "epochs": 2,
            "trackers": ["mlflow"],
            "log_every": 1,
            "ckpt_every_steps": 2,
            "keep_checkpoints": 20,
        },
    )
    proc, _, run = train_until_logged(recipe, tmp_path, records=5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 75, proc.stderr.read()[-2000:]
    newest = sorted((run / "checkpoints").glob("ckpt-*.pt"))[-1]
    newest.write_bytes(b"")  # lost: the resume goes back to an older one, re-running logged steps
    with pytest.warns(UserWarning, match="truncated or corrupt"):
        summary = train(recipe, run, progress=False, resume="auto")
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    (found,) = client.search_runs([client.get_experiment_by_name("stallfree").experiment_id])
    assert found.info.status == "FINISHED"
    losses = client.get_metric_history(found.info.run_id, "loss")
    assert sorted(m.step for m in losses) == list(range(1, 15))
    jsonl = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {m.step: m.value for m in losses} == {r["step"]: r["loss"] for r in jsonl if "loss" in r}
    history = client.get_metric_history(found.info.run_id, "val_top1")
    assert [m.step for m in history] == [7, 14]
    assert history[-1].value == pytest.approx(summary["val_top1"])


def test_a_missing_tracker_is_named_before_anything_is_written(
    image_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    recipe = small_recipe(image_root, train={"trackers": ["wandb"]})
    with pytest.raises(RecipeError, match="train.trackers includes 'wandb'.*pip install wandb"):
        train(recipe, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_missing_tensorboard_is_said_once_with_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # None in sys.modules makes the import fail, as it does without the tensorboard package.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    sinks = SinkSet()
    with caplog.at_level(logging.INFO, logger="stallfree"):
        sinks.open(tmp_path)
        for step in (1, 2):
            sinks.write({"step": step, "loss": 1.0})
        sinks.close()
    said = [r.getMessage() for r in caplog.records if "TensorBoard" in r.getMessage()]
    assert len(said) == 1 and "pip install -e '.[tb]'" in said[0], said
    assert not (tmp_path / "tb").exists()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_tensorboard_is_written_when_installed(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tb extra: pip install -e '.[tb]' (make installs it)")
    sinks = SinkSet()
    sinks.open(tmp_path)
    sinks.write({"step": 1, "loss": 1.0})
    sinks.close()
    assert [f.stat().st_size > 0 for f in (tmp_path / "tb").glob("events.out.tfevents.*")] == [True]
