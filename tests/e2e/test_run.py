"""End to end: recipe -> loader -> trainer -> run directory, through the CLI too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import PYTHON, small_recipe, stop_after, torchrun_train, train_until_logged
from inprocess import Cli

from stallfree.data.tools.demo import write_demo
from stallfree.recipe import dump_toml, load_recipe, tomllib
from stallfree.train.checkpoint import load_checkpoint
from stallfree.train.run import train

pytestmark = pytest.mark.e2e  # every test here trains a run or starts a process


@pytest.fixture(scope="module")
def learnable_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 0.4 of the demo's size (80-200 px): the run crops 32 px, so bigger files would only
    # cost decode time (this test once took a minute of CPU, most of it decoding).
    return write_demo(
        tmp_path_factory.mktemp("learn"),
        train_per_class=40,
        val_per_class=10,
        seed=3,
        progress=False,
        scale=0.4,
    )


@pytest.mark.slow
def test_short_demo_run_beats_chance(learnable_root: Path, tmp_path: Path) -> None:
    recipe = small_recipe(
        learnable_root,
        augment={"image_size": 32, "resize_size": 36, "scale": [0.35, 1.0]},
        optim={"lr": 0.005, "weight_decay": 0.05, "warmup_steps": 10, "label_smoothing": 0.1},
        # auto: bf16 where the CPU has it natively; emulated bf16 is 7.6x slower than fp32
        train={"epochs": 10, "batch_size": 32, "precision": "auto", "log_every": 5},
        loader={"torch": {"workers": 2}},
    )
    summary = train(recipe, tmp_path / "run", progress=False)
    # 10 classes: chance is 0.10; this run measured 0.33 (0.37 at 14 epochs, 0.23 at 7).
    assert summary["val_top1"] >= 0.25, summary
    run = tmp_path / "run"
    assert load_recipe(run / "recipe.toml") == recipe  # as given: "auto" stays "auto"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "loss" in r]
    val_records = [r for r in records if "val_top1" in r]
    assert len(val_records) == 10 and all(r["val_loss"] > 0 for r in val_records)
    assert train_records[-1]["loss"] < train_records[0]["loss"]
    for key in ("step", "epoch", "loss", "lr", "images_per_s", "data_wait_frac"):
        assert key in train_records[0]
    saved = json.loads((run / "summary.json").read_text())
    for key in ("images_per_s", "data_wait_frac", "val_top1", "wall_s"):
        assert isinstance(saved[key], float)


def test_cli_train_with_overrides_and_compare(image_root: Path, tmp_path: Path, cli: Cli) -> None:
    recipe_path = tmp_path / "r.toml"
    recipe_path.write_text(dump_toml(small_recipe(image_root)))
    out = tmp_path / "run"
    flags = ["--loader", "synthetic", "--device", "cpu", "--epochs", "2", "--out", out]
    assert cli("train", recipe_path, *flags, "--set", "train.batch_size=4", "--no-progress").code == 0
    saved = load_recipe(out / "recipe.toml")
    assert saved.loader.backend == "synthetic" and saved.train.epochs == 2
    assert saved.train.batch_size == 4
    compared = cli("compare", out)
    assert compared.code == 0
    assert "synthetic" in compared.out


def test_a_cli_run_keeps_its_recipe_as_given_and_says_what_auto_became(
    image_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli: Cli
) -> None:
    """recipe.toml is the recipe after the flags and --set, "auto" kept; resolved.toml and the
    checkpoints say what it became; each check of the recipe runs once; the default folder is
    named by the backend that ran."""
    import stallfree.data.registry as registry
    import stallfree.recipe as recipe_module

    checks: list[str] = []
    for real in (recipe_module.validate, registry.check_data_root):

        def counted(recipe: Any, real: Any = real) -> None:
            checks.append(real.__name__)
            real(recipe)

        for name, module in list(sys.modules.items()):
            if name.startswith("stallfree") and getattr(module, real.__name__, None) is real:
                monkeypatch.setattr(module, real.__name__, counted)
    monkeypatch.chdir(tmp_path)
    given = small_recipe(image_root, train={"precision": "auto"})
    Path("r.toml").write_text(dump_toml(given))
    flags = ["--loader", "auto", "--epochs", "1", "--set", "train.batch_size=10", "--no-progress"]
    done = cli("train", "r.toml", *flags)
    assert done.code == 0
    assert sorted(checks) == ["check_data_root", "validate"]
    (run,) = Path("runs").iterdir()
    assert run.name.startswith("r-torch-")  # --loader auto chose torch on this CPU
    given.loader.backend, given.train.batch_size = "auto", 10
    assert (run / "recipe.toml").read_text() == dump_toml(given)
    resolved = tomllib.loads((run / "resolved.toml").read_text())
    assert (resolved["backend"], resolved["device"], resolved["io_depth"]) == ("torch", "cpu", 16)
    saved = load_checkpoint(max((run / "checkpoints").glob("ckpt-*.pt")))
    assert saved["recipe"] == given.to_dict() and saved["resolved"] == resolved
    assert f"torch loader, small_cnn, cpu, precision {resolved['precision']}" in done.err


def test_python_dash_m_entry_point() -> None:
    result = subprocess.run([PYTHON, "-m", "stallfree", "--help"], capture_output=True, text=True, check=True)
    assert "train" in result.stdout and "data" in result.stdout


@pytest.mark.slow
def test_torchrun_resumes_another_world_size_and_is_preempted(
    image_root: Path, tmp_path: Path, cli: Cli
) -> None:
    """1 rank -> 2 ranks (DDP over gloo) at a step boundary; SIGTERM to torchrun leaves the
    marker that the requeue loop reads; 2 ranks -> 1 rank finishes the run."""
    # 60 images, global batch 16 (1 rank x 8 x accum 2, or 2 ranks x 4 x 2): 7 global
    # micro-batches of 8 an epoch (4 dropped), windows 2,2,2,1: 4 steps an epoch either way.
    one = small_recipe(
        image_root,
        train={
            "epochs": 40,
            "batch_size": 8,
            "accum_steps": 2,
            "ckpt_every_steps": 1,
            "keep_checkpoints": 50,
        },
    )
    recipe_path = tmp_path / "r.toml"
    recipe_path.write_text(dump_toml(one))
    run = tmp_path / "run"
    # The one-rank segments run in this process (no second torch start-up); the DDP one cannot.
    single = ["train", str(recipe_path), "--out", str(run), "--no-progress"]
    assert cli(*single, "--epochs", "1").code == 0
    for late in (3, 4):  # resume from step 2: mid-epoch 0, after 32 of the 60 samples
        (run / "checkpoints" / f"ckpt-{late:09d}.pt").unlink()
    (run / "summary.json").unlink()
    # --force: the recipe's 40 epochs, not the 1 the first run was told (a re-laid schedule).
    two = torchrun_train(
        str(recipe_path), "--out", str(run), "--resume", "auto", "--force", "--set", "train.batch_size=4"
    )
    proc = subprocess.Popen(
        two, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        if len(metrics.read_text().splitlines()) >= 8:  # the resumed DDP run is stepping
            break
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    os.killpg(proc.pid, signal.SIGTERM)  # as a scheduler does: torchrun and its workers
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0  # torchrun reports a failure whatever its workers returned...
    marker = json.loads((run / "preempted.json").read_text())  # ...so the loop reads this
    state = load_checkpoint(Path(marker["checkpoint"]))
    assert state["world_size"] == 2 and len(state["ranks"]) == 2, err[-2000:]
    stopped_at = state["counters"]["optimizer_steps"]
    assert stopped_at >= 4  # the resumed DDP run finished epoch 0 with 2 steps, as 1 rank would

    epochs = stopped_at // 4 + 2  # finish the epoch it stopped in, and one more
    assert cli(*single, "--resume", "auto", "--force", "--epochs", str(epochs)).code == 0
    assert not (run / "preempted.json").exists()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["optimizer_steps"] == 4 * epochs


def test_ctrl_c_finishes_the_step_saves_and_exits_130(image_root: Path, tmp_path: Path) -> None:
    recipe = small_recipe(image_root, train={"epochs": 50, "batch_size": 4, "log_every": 1})
    proc, _, run = train_until_logged(recipe, tmp_path, records=3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "checkpoint saved" in err
    assert not (run / "preempted.json").exists()  # a user's stop is not a preemption to requeue
    assert len(list((run / "checkpoints").glob("ckpt-*.pt"))) >= 1


def test_warmup_longer_than_the_run_is_warned(image_root: Path, tmp_path: Path) -> None:
    recipe = small_recipe(image_root, optim={"warmup_steps": 500})
    with pytest.warns(UserWarning, match="warmup_steps.*never decays"):
        train(recipe, tmp_path / "run", progress=False)


def test_summary_and_record_carry_the_resolved_precision(image_root: Path, tmp_path: Path) -> None:
    from stallfree.train.precision import cpu_has_native_bf16

    recipe = small_recipe(image_root, train={"precision": "auto", "batch_size": 16})
    summary = train(recipe, tmp_path / "run", progress=False)
    expected = "bf16" if cpu_has_native_bf16() else "fp32"
    assert summary["precision"] == expected
    assert tomllib.loads((tmp_path / "run" / "resolved.toml").read_text())["precision"] == expected


def test_the_cli_imports_without_torch() -> None:
    """`stallfree --help` and argument errors answer without loading torch (seconds saved)."""
    code = "import sys, stallfree.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


@pytest.mark.parametrize(
    ("step_s", "said"),
    [
        (1.0, "about 1.0 min to go (71 steps in all at 1.00 s each"),
        (0.1, "about 6 s to go (71 steps in all at 0.10 s each"),
        (0.001, "less than a second to go (71 steps in all at 0.00 s each"),
        (100.0, "about 1.7 h to go (71 steps in all at 100.00 s each"),
    ],
    ids=["minutes", "seconds", "under-a-second", "hours"],
)
def test_time_to_go_leaves_start_up_out(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, step_s: float, said: str
) -> None:
    """A first step that waited 60 s for workers or a DALI graph, then 60 steps to go: the
    estimate is the steps', not the start-up's spread over them, in a unit that reads."""
    from types import SimpleNamespace

    from stallfree.train import progress

    now = [40.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    trainer = SimpleNamespace(optimizer_steps=0, dist=SimpleNamespace(rank=0))
    eta = progress.TimeToGo(trainer, total_steps=71)
    now[0], trainer.optimizer_steps = 100.0, 1
    eta.step()  # step 1 ends 60 s after the start: the clock starts here
    caplog.set_level("INFO", logger="stallfree")
    for steps in range(2, 12):
        now[0], trainer.optimizer_steps = 100.0 + (steps - 1) * step_s, steps
        eta.step()
    lines = [r.getMessage() for r in caplog.records if "to go" in r.getMessage()]
    assert lines == [f"{said}; validation not included)"]


def test_a_resume_with_another_epoch_count_is_refused_unless_forced(image_root: Path, tmp_path: Path) -> None:
    """Extending a finished run re-lays the LR schedule over the new count (the LR jumps back
    up), so it must be asked for, not happen because --epochs changed."""
    from stallfree.train.resume import ResumeError

    recipe = small_recipe(image_root, train={"batch_size": 16, "epochs": 2}, optim={"warmup_steps": 0})
    run = tmp_path / "run"
    train(recipe, run, progress=False)
    before = (run / "metrics.jsonl").read_text()
    recipe.train.epochs = 3
    with pytest.raises(
        ResumeError,
        match=r"train.epochs: checkpoint 2, now 3.*"
        r"--epochs 2.*--force.*schedule",
    ) as err:
        train(recipe, run, progress=False, resume="auto")
    assert "\n" not in str(err.value)
    assert (run / "metrics.jsonl").read_text() == before  # refused before anything was written
    assert train(recipe, run, progress=False, resume="auto", force=True)["optimizer_steps"] == 9


def test_the_summary_after_a_requeue_sums_every_segment(
    image_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped after step 3 (as by SIGTERM), then resumed: summary.json counts the time and
    images of both segments, not of the last one alone."""
    import stallfree.train.run as run_module
    from stallfree.train.trainer import PreemptedError

    recipe = small_recipe(image_root, train={"epochs": 2, "log_every": 2}, optim={"warmup_steps": 0})
    run = tmp_path / "run"
    monkeypatch.setattr(run_module, "StopSignal", stop_after(3))
    started = time.perf_counter()
    with pytest.raises(PreemptedError):
        train(recipe, run, progress=False)
    first = time.perf_counter() - started
    monkeypatch.undo()
    started = time.perf_counter()
    summary = train(recipe, run, progress=False, resume="auto")
    second = time.perf_counter() - started
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "loss" in r]
    assert {r["step"] for r in timed} == {2, 4, 6, 7, 8, 10, 12, 14}  # each interval once
    assert (
        summary["optimizer_steps"],
        second < summary["wall_s"] <= first + second,
        summary["images_per_s"],
    ) == (14, True, pytest.approx(sum(r["images"] for r in timed) / sum(r["interval_s"] for r in timed)))
    assert summary["images"] == sum(r["images"] for r in timed) and summary["segments"] == 2
    # Step 3 was mid-interval: the resumed records and counters are an uninterrupted run's.
    straight = train(recipe, tmp_path / "straight", progress=False)
    clock = ("images_per_s", "data_wait_frac", "interval_s", "wall_s", "train_s", "segments")

    def untimed(path: Path) -> list[dict]:
        rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k not in clock} for r in rows]

    assert untimed(run) == untimed(tmp_path / "straight")
    counters = ("images", "optimizer_steps", "skipped_steps", "val_top1", "val_loss")
    assert {k: summary[k] for k in counters} == {k: straight[k] for k in counters}
