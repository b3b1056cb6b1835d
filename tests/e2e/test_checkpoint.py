"""Checkpoints: atomic saves, fallback, pruning, safe loading, exact resume, preemption."""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import small_recipe, train_until_logged
from inprocess import Cli

from stallfree.errors import PREEMPTED_EXIT_CODE, RunDirError
from stallfree.train.checkpoint import Checkpointer, CheckpointError, load_checkpoint
from stallfree.train.resume import ResumeError
from stallfree.train.run import train

pytestmark = pytest.mark.e2e  # every test here trains a run or starts a process

BACKENDS = ["torch", pytest.param("dali", marks=pytest.mark.dali)]


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((4,), value)}, "epoch": 0}


def test_keep_last_n_deletes_only_old_checkpoints(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    ckpt = Checkpointer(tmp_path, keep=3)
    for step in range(1, 6):
        ckpt.save(_state(step), step)
    assert [p.name for p in ckpt.paths()] == [f"ckpt-{s:09d}.pt" for s in (5, 4, 3)]
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert (tmp_path / "latest").read_text().strip() == "ckpt-000000005.pt"


def test_corrupt_newest_falls_back_to_the_previous(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path)
    ckpt.save(_state(1.0), 1)
    newest = ckpt.save(_state(2.0), 2)
    newest.write_bytes(newest.read_bytes()[:100])  # truncated, as by a full disk
    with pytest.warns(UserWarning, match="ckpt-000000002.pt is truncated or corrupt"):
        state, path = ckpt.load_latest()
    assert path.name == "ckpt-000000001.pt" and float(state["model"]["w"][0]) == 1.0


def test_crash_between_write_and_rename_keeps_the_old_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = Checkpointer(tmp_path)
    ckpt.save(_state(1.0), 1)

    def crash(*args: object) -> None:
        raise OSError("killed between write and rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="killed"):
        ckpt.save(_state(2.0), 2)
    monkeypatch.undo()
    state, path = ckpt.load_latest()
    assert path.name == "ckpt-000000001.pt" and float(state["model"]["w"][0]) == 1.0
    assert [p.name for p in ckpt.paths()] == ["ckpt-000000001.pt"]


class Payload:
    """Stands for any object whose unpickling could run code."""

    def __reduce__(self) -> tuple:
        return (print, ("this ran during unpickling",))


def test_pickled_objects_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "ckpt-000000001.pt"
    torch.save({"model": {}, "extra": Payload()}, path)
    with pytest.raises(CheckpointError, match=r"allow-list .*: builtins\.print; refusing") as err:
        load_checkpoint(path)
    assert "GLOBAL" not in str(err.value)  # named by torch's API, not cut from its message


def _torchscript(path: Path) -> None:
    torch.jit.script(torch.nn.Linear(2, 2)).save(str(path))


def _pt2(path: Path) -> None:
    program = torch.export.export(torch.nn.Linear(2, 2), (torch.zeros(1, 2),))
    torch.export.save(program, path)  # what `stallfree export` writes as model.pt2


@pytest.mark.parametrize(
    ("write", "what"),
    [
        (lambda p: p.write_text("junk\n"), "is a text file"),
        (lambda p: p.write_text("hello, world\n"), "is a text file"),
        (lambda p: p.write_bytes(b"\0" * 4096), "is zero-filled"),
        (lambda p: p.write_bytes(bytes(range(7, 256)) * 16), "is truncated or corrupt"),
        (lambda p: p.write_bytes(b""), "is truncated or corrupt"),
        (_torchscript, "is a TorchScript export"),
        (_pt2, "is a torch.export program"),
    ],
    ids=["junk", "text", "zeros", "binary", "empty", "torchscript", "pt2"],
)
def test_a_file_posing_as_the_newest_checkpoint_is_named_and_skipped(
    tmp_path: Path, write: Callable[[Path], object], what: str
) -> None:
    ckpt = Checkpointer(tmp_path)
    ckpt.save(_state(1.0), 1)
    write(tmp_path / "ckpt-000000021.pt")
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(tmp_path / "ckpt-000000021.pt")
    message = str(refused.value)
    assert f"ckpt-000000021.pt {what}" in message, message
    assert "\n" not in message and "weights_only" not in message, message  # one line, ours
    with pytest.warns(UserWarning, match=f"ckpt-000000021.pt {what}.*next older"):
        state, path = ckpt.load_latest()
    assert path.name == "ckpt-000000001.pt" and float(state["model"]["w"][0]) == 1.0


def test_commands_name_a_file_that_is_no_checkpoint(image_root: Path, tmp_path: Path, cli: Cli) -> None:
    """predict, eval and export on a text file: exit 2 and one line naming it, no traceback."""
    from stallfree.recipe import dump_toml

    junk = tmp_path / "ckpt-000000021.pt"
    junk.write_text("junk\n")
    recipe = tmp_path / "r.toml"
    recipe.write_text(dump_toml(small_recipe(image_root)))
    image = str(next((image_root / "val").rglob("*.jpg")))
    for argv in (
        ["predict", str(junk), image],
        ["eval", str(recipe), "--checkpoint", str(junk)],
        ["export", str(junk), "--out", str(tmp_path / "export")],
    ):
        done = cli(*argv)
        assert done.code == 2, argv
        errors = [line for line in done.err.splitlines() if "error:" in line]
        assert len(errors) == 1 and f"{junk} is a text file" in errors[0], (argv, errors)


def _resume_recipe(root: Path, backend: str):
    # 60 images / batch 8 = 7 batches; accum 2 -> windows 2,2,2,1 = 4 optimizer steps an epoch.
    return small_recipe(
        root,
        train={"epochs": 2, "accum_steps": 2, "ckpt_every_steps": 1, "keep_checkpoints": 20, "log_every": 1},
        loader={"backend": backend},
        optim={"name": "sgd", "lr": 0.05},
    )


def _losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def full_run(image_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The uninterrupted `_resume_recipe` run of a backend (8 steps, a checkpoint at each),
    trained once per module and copied from, never written to, by the resume tests."""
    made: dict[str, Path] = {}

    def get(backend: str) -> Path:
        if backend not in made:
            path = tmp_path_factory.mktemp(f"full-{backend}")
            assert train(_resume_recipe(image_root, backend), path, progress=False)["optimizer_steps"] == 8
            made[backend] = path
        return made[backend]

    return get


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_mid_epoch_is_bitwise_equal(
    image_root: Path, tmp_path: Path, backend: str, full_run: Callable[[str], Path]
) -> None:
    recipe = _resume_recipe(image_root, backend)
    full = full_run(backend)
    final = load_checkpoint(full / "checkpoints" / "ckpt-000000008.pt")
    for k in (2, 4, 5):  # mid-epoch 0 (after 4 of 7 batches), its end, and mid-epoch 1
        run = tmp_path / f"resumed-{k}"
        (run / "checkpoints").mkdir(parents=True)
        shutil.copy(full / "checkpoints" / f"ckpt-{k:09d}.pt", run / "checkpoints")
        summary = train(recipe, run, progress=False, resume="auto")
        assert summary["optimizer_steps"] == 8
        resumed = load_checkpoint(run / "checkpoints" / "ckpt-000000008.pt")
        for name, tensor in final["model"].items():
            assert torch.equal(tensor, resumed["model"][name]), (k, name)
        expected = {s: v for s, v in _losses(full).items() if s > k}
        assert _losses(run) == expected


@pytest.mark.parametrize("workers", [0, 1])
def test_resume_is_bitwise_with_dropout_and_torch_workers(
    image_root: Path, tmp_path: Path, workers: int
) -> None:
    """Dropout draws from torch's generator in forward: nothing may draw from it between the
    restore and the first step (a DataLoader's iterator once did, for its workers' seed)."""
    recipe = _resume_recipe(image_root, "torch")
    recipe.model.drop_rate, recipe.loader.torch.workers = 0.5, workers
    full = tmp_path / "full"
    train(recipe, full, progress=False)
    final = load_checkpoint(full / "checkpoints" / "ckpt-000000008.pt")
    run = tmp_path / "resumed"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(full / "checkpoints" / "ckpt-000000002.pt", run / "checkpoints")
    train(recipe, run, progress=False, resume="auto")
    resumed = load_checkpoint(run / "checkpoints" / "ckpt-000000008.pt")
    for name, tensor in final["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name


def test_resume_refuses_a_different_global_batch(image_root: Path, tmp_path: Path) -> None:
    recipe = _resume_recipe(image_root, "torch")
    recipe.train.epochs = 1
    train(recipe, tmp_path, progress=False)
    recipe.train.batch_size = 4
    recipe.loader.backend = "synthetic"
    with pytest.raises(ResumeError, match=r"global batch.*loader.backend.*--force"):
        train(recipe, tmp_path, progress=False, resume="auto")
    recipe.train.epochs = 2
    assert train(recipe, tmp_path, progress=False, resume="auto", force=True)["optimizer_steps"] > 4


@pytest.mark.slow
def test_sigterm_saves_exits_75_and_resumes(image_root: Path, tmp_path: Path, cli: Cli) -> None:
    # 3 epochs of 15 steps: signalled after step 3, 42 steps of margin, and a short resume.
    recipe = small_recipe(image_root, train={"epochs": 3, "batch_size": 4, "log_every": 1})
    proc, cmd, run = train_until_logged(recipe, tmp_path, records=3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == PREEMPTED_EXIT_CODE, err
    assert "--resume auto" in err
    state, path = Checkpointer(run / "checkpoints").load_latest()
    steps_done = state["counters"]["optimizer_steps"]
    assert 0 < steps_done < 3 * 15  # stopped mid-run, not at the end
    assert state["ranks"][0]["loader"]["position"] > 0 or steps_done % 15 == 0
    # The resume's subject is the run, not its process: in this one.
    resumed = cli(*cmd[cmd.index("train") :], "--resume", "auto")
    assert resumed.code == 0, resumed.err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["optimizer_steps"] == 3 * 15


def test_pruning_never_deletes_the_checkpoint_just_written(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, keep=3)
    for step in (6, 12, 18):  # higher step numbers than the save below
        ckpt.save(_state(step), step)
    ckpt.save(_state(3.0), 3)
    assert (tmp_path / "ckpt-000000003.pt").exists()
    assert (tmp_path / "latest").read_text().strip() == "ckpt-000000003.pt"


def test_a_fresh_run_never_reuses_another_runs_directory(image_root: Path, tmp_path: Path) -> None:
    recipe = small_recipe(image_root, train={"batch_size": 16})
    train(recipe, tmp_path, progress=False)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(RunDirError, match=r"ckpt-000000003\.pt.*--resume auto.*another --out"):
        train(recipe, tmp_path, progress=False)
    after = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before  # nothing written, nothing deleted
    # The finished run, requeued: nothing to do, the summary stands.
    assert train(recipe, tmp_path, progress=False, resume="auto")["optimizer_steps"] == 3


def test_resume_cuts_metrics_back_to_the_checkpoint(
    image_root: Path, tmp_path: Path, full_run: Callable[[str], Path]
) -> None:
    recipe = _resume_recipe(image_root, "torch")
    full = full_run("torch")
    run = tmp_path / "run"
    shutil.copytree(full, run)
    for later in range(4, 9):  # as if the run died after step 3's checkpoint was written
        (run / "checkpoints" / f"ckpt-{later:09d}.pt").unlink()
    train(recipe, run, progress=False, resume="auto")

    def records(path: Path) -> list[tuple]:
        rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["epoch"], r.get("loss"), r.get("val_top1")) for r in rows]

    assert records(run) == records(full)  # each record once, none lost, none repeated


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_with_another_micro_batch_split(
    image_root: Path, tmp_path: Path, backend: str, full_run: Callable[[str], Path]
) -> None:
    # 60 samples, global batch 16: 7 micro-batches of 8 (windows 2,2,2,1) or 15 of 4 (4,4,4,3),
    # 4 steps an epoch either way. Step 2 has consumed 32 samples; 28 remain: windows 4,3.
    run = tmp_path / "b"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(full_run(backend) / "checkpoints" / "ckpt-000000002.pt", run / "checkpoints")
    new = _resume_recipe(image_root, backend)
    new.train.batch_size, new.train.accum_steps = 4, 4
    summary = train(new, run, progress=False, resume="auto")
    assert summary["optimizer_steps"] == 8  # 2 more steps in epoch 0 (not 4: none repeated), 4 in 1
    state = load_checkpoint(run / "checkpoints" / "ckpt-000000004.pt")
    assert state["ranks"][0]["loader"]["epoch"] == 1 and state["ranks"][0]["loader"]["position"] == 0


def test_a_checkpoint_counting_batches_is_refused(image_root: Path, tmp_path: Path) -> None:
    recipe = small_recipe(image_root, train={"batch_size": 16})
    train(recipe, tmp_path / "a", progress=False)
    path = tmp_path / "a" / "checkpoints" / "ckpt-000000003.pt"
    state = torch.load(path, weights_only=True)
    del state["format"]  # as stallfree 0.1 wrote it: no format, position in batches
    for rank in state["ranks"]:
        rank["loader"] = {"epoch": rank["loader"]["epoch"], "position": 2}
    state["stallfree_version"] = "0.1.0"
    torch.save(state, path)
    recipe.train.epochs = 2
    with pytest.raises(ResumeError, match="stallfree 0.1.0.*position in batches"):
        train(recipe, tmp_path / "a", progress=False, resume="auto")


def test_sigterm_to_the_whole_process_group_with_workers(image_root: Path, tmp_path: Path) -> None:
    """As a scheduler signals: the DataLoader workers get SIGTERM too, and must not end the run
    before the main process has saved."""
    recipe = small_recipe(
        image_root, train={"epochs": 8, "batch_size": 4, "log_every": 1}, loader={"torch": {"workers": 1}}
    )
    proc, _, run = train_until_logged(recipe, tmp_path, records=3, new_session=True)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == PREEMPTED_EXIT_CODE, err[-2000:]
    assert (run / "preempted.json").exists()
    assert Checkpointer(run / "checkpoints").load_latest() is not None


def test_best_checkpoint_keeps_the_best_epoch(
    image_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """best.pt holds the weights of the epoch with the best val top-1, survives pruning and
    is what `stallfree eval` reads; every validation record carries val_loss."""
    import stallfree.train.trainer as trainer_module
    from stallfree.train.accuracy import evaluate_model

    scripted = iter([0.2, 0.5, 0.3])

    def scripted_eval(*args, **kwargs):  # the real evaluation, with a chosen top-1
        return {**evaluate_model(*args, **kwargs), "val_top1": next(scripted)}

    monkeypatch.setattr(trainer_module, "evaluate_model", scripted_eval)
    recipe = small_recipe(image_root, train={"epochs": 3, "keep_checkpoints": 2, "ckpt_every_steps": 1})
    run = tmp_path / "run"
    train(recipe, run, progress=False)
    assert sorted(p.name for p in (run / "checkpoints").glob("*.pt")) == [
        "best.pt",
        "ckpt-000000020.pt",
        "ckpt-000000021.pt",
    ]  # pruned around it
    best = load_checkpoint(run / "checkpoints" / "best.pt")
    assert (best["epoch"], best["val_top1"]) == (1, 0.5)
    last = load_checkpoint(run / "checkpoints" / "ckpt-000000021.pt")
    assert last["counters"]["best_val_top1"] == 0.5  # a resume keeps comparing against it
    assert any(not torch.equal(best["model"][k], last["model"][k]) for k in best["model"])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["val_loss"] for r in records if "val_top1" in r]
    assert len(losses) == 3 and all(0 < loss < 10 for loss in losses)
    from stallfree.train.evaluate import evaluate_checkpoint

    assert evaluate_checkpoint(recipe, run / "checkpoints" / "best.pt")["samples"] == 30


def test_every_command_reads_a_run_directory_alike(
    image_root: Path, tmp_path: Path, full_run: Callable[[str], Path], cli: Cli
) -> None:
    """A run directory means one file for predict, eval and export (its best.pt), said on
    stderr; `checkpoints/latest` is accepted by them and by `train --resume`."""
    from stallfree.recipe import dump_toml

    full = full_run("torch")
    recipe = tmp_path / "r.toml"
    recipe.write_text(dump_toml(_resume_recipe(image_root, "torch")))
    image = str(next((image_root / "val").rglob("*.jpg")))
    best, latest = full / "checkpoints" / "best.pt", full / "checkpoints" / "latest"
    for target, chosen in (
        (full, best),
        (full / "checkpoints", best),
        (latest, full / "checkpoints" / "ckpt-000000008.pt"),
    ):
        for argv in (
            ["predict", str(target), image],
            ["eval", str(recipe), "--checkpoint", str(target)],
            ["export", str(target), "--out", str(tmp_path / "export"), "--format", "pt2"],
        ):
            done = cli(*argv)
            assert done.code == 0, argv
            assert str(chosen) in done.err, argv
    run = tmp_path / "run"
    shutil.copytree(full, run)
    summary = train(
        _resume_recipe(image_root, "torch"), run, progress=False, resume=str(run / "checkpoints" / "latest")
    )
    assert summary["optimizer_steps"] == 8  # the finished run, found through `latest`
