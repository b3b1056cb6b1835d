"""Resume: which checkpoint a run continues from, and what must match for it to continue.

What goes into a checkpoint is train/checkpoint/manager.py's; this reads a saved one only
through `SavedCheckpoint`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stallfree.data import storage
from stallfree.data.readers.listing import Dataset
from stallfree.errors import StallfreeError
from stallfree.log import LOGGER
from stallfree.recipe import Recipe
from stallfree.resolved import Resolved
from stallfree.train.checkpoint import LATEST, Checkpointer, SavedCheckpoint, latest_target


class ResumeError(StallfreeError, ValueError):
    """A checkpoint whose run differs from this one in a way that changes its meaning."""


def data_record(dataset: Dataset | None) -> dict[str, Any]:
    """What a run trains on, as its checkpoints record it: train's sample count and a digest of
    its files (relative to the root, so a local copy and the store agree) and labels. {} for
    a run without a dataset (the synthetic backends)."""
    if dataset is None or "train" not in dataset.splits:
        return {}
    listing = dataset.splits["train"]
    return {"train_samples": len(listing), "train_digest": listing.digest(with_prefix=False)}


def check_same_data(
    checkpoint: SavedCheckpoint, now: dict[str, Any], dataset: Dataset | None, force: bool = False
) -> None:
    """Refuse a mid-epoch resume on other data than the checkpoint's; `now` is `data_record`
    of `dataset` (made once a run: it hashes every train file's name).

    Positions are samples of a permutation of the listing: with one file more or less, or a
    label changed, the rest of the epoch is dealt from another order, training some samples
    twice and others never, silently. At an epoch's start nothing of the epoch was read, so
    the new data is only said; `force` goes on mid-epoch too, saying what it costs.
    """
    saved, path = checkpoint.data, checkpoint.path
    cached = dataset.cached_listing if dataset is not None else ""
    if cached and saved == now:  # the claim checked: the checkpoint's positions count it
        LOGGER.info(f"resuming on {cached}, which the checkpoint's positions count")
    if not saved or not now or saved == now or dataset is None:
        return  # a checkpoint from before this record, or no listing at all
    position = checkpoint.position
    where = dataset.splits["train"].prefix.rstrip("/")
    change = f"{saved['train_samples']} samples at the checkpoint, {now['train_samples']} now" + (
        ", other files or labels" if saved["train_samples"] == now["train_samples"] else ""
    )
    if cached:  # this node's cached listing is not the checkpoint's: stale, the likely cause
        change += f"; this node resumed on {cached}, the likely cause"
    epoch = checkpoint.epoch
    if position == 0:
        LOGGER.warning(f"{where} changed since {path.name} ({change}): epoch {epoch} reads it as it is now")
    elif force:
        LOGGER.warning(
            f"{where} changed since {path.name} ({change}); --force: the rest of epoch {epoch} "
            "is dealt from the new listing, so some samples may be trained twice or missed"
        )
    else:
        raise ResumeError(
            f"cannot resume from {path} mid-epoch {epoch}: {where} changed since it was saved "
            f"({change}), so the rest of the epoch would train some samples twice and others "
            "never; restore the data as it was, resume from an epoch-end checkpoint, or pass "
            "--force to go on anyway"
        )


def _root_named(root: str) -> str:
    """A local root resolved (a relative one names a folder from where it ran), a URL as is."""
    if not root:
        return ""
    return str(storage.locate(root).resolved())


def _semantics(recipe: dict[str, Any], backend: str, world_size: int) -> dict[str, Any]:
    train = recipe["train"]
    return {
        "global batch (train.batch_size x train.accum_steps x world size)": train["batch_size"]
        * train["accum_steps"]
        * world_size,
        "loader.backend": backend,  # the one that ran: "auto" decided
        "data.root": _root_named(recipe["data"]["root"]),
        "model.name": recipe["model"]["name"],
        "train.epochs": train["epochs"],  # the LR schedule's length
    }


def check_compatible(
    checkpoint: SavedCheckpoint,
    recipe: Recipe,
    resolved: Resolved,
    world_size: int,
    force: bool = False,
) -> None:
    """Refuse to resume a run whose global batch, backend (as `resolved`, "auto" decided),
    data, model or epoch count differ.

    The micro-batch split and the world size may change as long as the global batch stays:
    positions are samples, so the resumed run continues on the next unseen sample. The epoch
    count lays out the LR schedule (warmup, then cosine to the last step): another count
    re-lays it mid-run, so the LR jumps (after a finished run, from near 0 back up); `force`
    accepts that, as it does the other differences.
    """
    path = checkpoint.path
    if not checkpoint.resumable:
        raise ResumeError(
            f"cannot resume from {path}: it was written by stallfree "
            f"{checkpoint.version}, which counted the loader "
            "position in batches, not samples; finish that run with the version "
            "that wrote it, or start this one in another --out"
        )
    saved_recipe = checkpoint.recipe
    saved = _semantics(saved_recipe, checkpoint.resolved.backend, checkpoint.world_size)
    now = _semantics(recipe.to_dict(), resolved.backend, world_size)
    diffs = [f"{key}: checkpoint {saved[key]!r}, now {now[key]!r}" for key in saved if saved[key] != now[key]]
    if diffs and not force:
        saved_epochs = saved_recipe["train"]["epochs"]
        done = (
            f" That run had already finished ({saved_epochs} epochs)."
            if checkpoint.epoch >= saved_epochs
            else ""
        )
        epochs = f" (--epochs {saved_epochs})" if saved_epochs != recipe.train.epochs else ""
        schedule = (
            " (with another train.epochs the LR schedule is re-laid over the new count, "
            "so the LR jumps to that curve's value at this step)"
            if epochs
            else ""
        )
        raise ResumeError(
            f"cannot resume from {path}: the run differs in "
            + "; ".join(diffs)
            + f".{done} Restore those settings{epochs}, pass --force to resume "
            f"anyway{schedule}, or use another --out."
        )


def find_resume(resume: str, checkpointer: Checkpointer) -> SavedCheckpoint | None:
    """`auto`: the newest checkpoint that loads (None if there is none); else the given file."""
    if resume == "auto":
        latest = checkpointer.load_latest()
        return SavedCheckpoint(*latest) if latest is not None else None
    path = Path(resume)
    if path.name == LATEST and path.is_file():
        path = latest_target(path)  # the newest checkpoint, as eval, predict and export read it
    if path.is_dir():
        raise ResumeError(
            f"--resume {path} is a directory; pass a checkpoint file "
            f"({path}/checkpoints/ckpt-<step>.pt) or --resume auto with --out {path}"
        )
    found = SavedCheckpoint.read(path)
    others = [p for p in checkpointer.paths() if p.resolve() != path.resolve()]
    if others and path.resolve().parent != checkpointer.directory.resolve():
        raise ResumeError(
            f"{checkpointer.directory} already holds another run's checkpoints "
            f"({', '.join(p.name for p in others[:3])}); resume into an empty --out"
        )
    newer = [p.name for p in others if _step(p) > found.optimizer_steps]
    if newer:
        raise ResumeError(
            f"{checkpointer.directory} holds checkpoints newer than {path.name} "
            f"({', '.join(newer)}): resuming would mix two histories; move them "
            "away first, or resume into another --out"
        )
    return found


def _step(path: Path) -> int:
    return int(path.stem.split("-")[1])
