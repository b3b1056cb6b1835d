"""A resume on data that changed since the checkpoint: positions are samples of a permutation of
the listing, so mid-epoch a listing with one file more or less re-deals the rest of the epoch
(some samples trained twice, others never) without any error. The checkpoint records what it
was trained on, and a mid-epoch resume on anything else is refused unless forced."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import small_recipe, stop_after

from stallfree.train.checkpoint import SavedCheckpoint, load_checkpoint
from stallfree.train.resume import ResumeError
from stallfree.train.trainer import PreemptedError

pytestmark = pytest.mark.e2e  # every test here trains a run or starts a process


@pytest.fixture
def stopped(image_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """(a copy of the data, a run stopped mid-epoch 0 on it)."""
    import stallfree.train.run as run_module
    from stallfree.train.run import train

    data, run = tmp_path / "data", tmp_path / "run"
    shutil.copytree(image_root, data)
    monkeypatch.setattr(run_module, "StopSignal", stop_after(2))  # mid-epoch 0
    with pytest.raises(PreemptedError):
        train(_recipe(data), run, progress=False)
    monkeypatch.undo()
    saved = load_checkpoint(sorted((run / "checkpoints").glob("ckpt-*.pt"))[-1])
    assert saved["ranks"][0]["loader"]["position"] > 0  # mid-epoch
    return data, run


def _recipe(data: Path):
    return small_recipe(data, train={"epochs": 2, "batch_size": 8}, optim={"warmup_steps": 0})


def test_a_mid_epoch_resume_on_changed_data_is_refused(stopped: tuple[Path, Path]) -> None:
    from stallfree.train.run import train

    data, run = stopped
    removed = sorted((data / "train").rglob("*.jpg"))[7]
    moved = removed.rename(data / removed.name)
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(ResumeError) as err:
        train(_recipe(data), run, progress=False, resume="auto")
    message = str(err.value)
    assert "\n" not in message
    assert f"{data}/train" in message and "60 samples" in message and "59 now" in message, message
    assert "--force" in message and "restore" in message, message
    assert (run / "metrics.jsonl").read_text() == before  # refused before anything was written
    # The same files again (moved back): the same listing, so the resume goes on.
    moved.rename(removed)
    assert train(_recipe(data), run, progress=False, resume="auto")["optimizer_steps"] == 14


def test_a_changed_file_of_the_same_name_is_not_the_same_data(stopped: tuple[Path, Path]) -> None:
    """A relabelled sample (a file moved to another class) keeps the count: the labels differ."""
    from stallfree.train.run import train

    data, run = stopped
    first, second = sorted(p for p in (data / "train").iterdir() if p.is_dir())[:2]
    one = sorted(first.glob("*.jpg"))[0]
    one.rename(second / one.name)
    with pytest.raises(ResumeError, match="60 samples at the checkpoint, 60 now, other files or labels"):
        train(_recipe(data), run, progress=False, resume="auto")
    # Forced: the user says the change is meant; the run goes on over the new listing.
    assert train(_recipe(data), run, progress=False, resume="auto", force=True)["optimizer_steps"] == 14


def test_a_store_root_is_named_as_written_in_the_refusal(tmp_path: Path) -> None:
    """An s3:// root was resolved as a local path in the refusal ('/cwd/s3:/bucket/a')."""
    from stallfree.resolved import Resolved
    from stallfree.train.resume import check_compatible
    from stallfree.version import __version__

    before, resolved = small_recipe("s3://bucket/a"), Resolved(backend="torch")
    state = {
        "stallfree_version": __version__,
        "recipe": before.to_dict(),
        "resolved": resolved.to_dict(),
        "world_size": 1,
        "ranks": [{"loader": {"epoch": 0, "position": 0}}],
    }
    with pytest.raises(ResumeError) as err:
        check_compatible(
            SavedCheckpoint(state, tmp_path / "ckpt.pt"), small_recipe("s3://bucket/b"), resolved, 1
        )
    assert "checkpoint 's3://bucket/a', now 's3://bucket/b'" in str(err.value), err.value


def test_a_resume_on_a_stale_cached_listing_says_so_in_its_one_line(tmp_path: Path) -> None:
    """The node's cached listing is not the one the checkpoint counts: the refusal names it
    and how to list again (no separate line claiming the checkpoint counts it)."""
    from stallfree.data.readers.listing import Dataset, ListingBuilder
    from stallfree.data.readers.remote import cached_note
    from stallfree.train.resume import check_same_data, data_record

    builder = ListingBuilder("s3://b/d/train/", ("a",))
    builder.add([f"{i}.jpg" for i in range(91)], [0] * 91)
    cached = cached_note(0.0, tmp_path / "listing-1.json.z")
    dataset = Dataset("s3://b/d", ("a",), {"train": builder.build()}, cached_listing=cached)
    state = {
        "data": {"train_samples": 92, "train_digest": "x"},
        "ranks": [{"loader": {"epoch": 0, "position": 8}}],
    }
    with pytest.raises(ResumeError) as err:
        saved = SavedCheckpoint(state, tmp_path / "ckpt-000000010.pt")
        check_same_data(saved, data_record(dataset), dataset)
    line = str(err.value)
    assert "92 samples at the checkpoint, 91 now" in line and f"resumed on {cached}" in line, line
    assert "STALLFREE_RELIST=1" in line and "likely cause" in line and "\n" not in line
