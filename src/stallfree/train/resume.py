"""Resume: what goes into a checkpoint, and what must match for a run to continue from it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stallfree.data import storage
from stallfree.data.loader import Loader
from stallfree.data.readers.listing import Dataset
from stallfree.errors import StallfreeError
from stallfree.log import LOGGER
from stallfree.recipe import Recipe
from stallfree.train.checkpoint import (
    LATEST,
    Checkpointer,
    latest_target,
    load_checkpoint,
    rng_state,
    set_rng_state,
)
from stallfree.train.ckpt_format import FORMAT, resumable
from stallfree.train.distributed import gather_objects
from stallfree.train.trainer import Trainer
from stallfree.version import __version__


class ResumeError(StallfreeError, ValueError):
    """A checkpoint whose run differs from this one in a way that changes its meaning."""


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """The checkpoint a run continues from: its state (at the current format) and its file."""

    state: dict[str, Any]
    path: Path


def training_state(
    trainer: Trainer,
    loader_state: dict[str, Any],
    recipe: Recipe,
    world_size: int,
    device: torch.device,
    metrics_records: int,
    num_classes: int = 0,
    class_names: list[str] | None = None,
    data: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything a resumed run needs to continue as if it had never stopped.

    Loader positions, RNG states and the open log interval's sums differ per rank, so every
    rank's are gathered; model, optimizer and schedule are the same on all ranks.
    `metrics_records` is how many lines metrics.jsonl held: a resume cuts it back to them.
    `data` is `data_record` of the run's dataset (what `check_same_data` compares).
    """
    per_rank = gather_objects(
        {"loader": loader_state, "rng": rng_state(device), "interval": trainer.interval_state()}, world_size
    )
    return {
        **trainer.state_dict(),
        "ranks": per_rank,
        "epoch": int(loader_state["epoch"]),
        "metrics_records": metrics_records,
        "recipe": recipe.to_dict(),
        "num_classes": num_classes,  # what the model was built with (stallfree export reads it)
        "class_names": list(class_names or []),  # label order; predict and export.json read it
        "world_size": world_size,
        "data": dict(data or {}),
        "stallfree_version": __version__,
        "format": FORMAT,  # a new key: bump FORMAT and give older files its default there
    }


def data_record(dataset: Dataset | None) -> dict[str, Any]:
    """What a run trains on, as its checkpoints record it: train's sample count and a digest of
    its files (relative to the root, so a local copy and the store agree) and labels. {} for
    a run without a dataset (the synthetic backends)."""
    if dataset is None or "train" not in dataset.splits:
        return {}
    listing = dataset.splits["train"]
    return {"train_samples": len(listing), "train_digest": listing.digest(with_prefix=False)}


def check_same_data(
    state: dict[str, Any], now: dict[str, Any], dataset: Dataset | None, path: Path, force: bool = False
) -> None:
    """Refuse a mid-epoch resume on other data than the checkpoint's; `now` is `data_record`
    of `dataset` (made once a run: it hashes every train file's name).

    Positions are samples of a permutation of the listing: with one file more or less, or a
    label changed, the rest of the epoch is dealt from another order, training some samples
    twice and others never, silently. At an epoch's start nothing of the epoch was read, so
    the new data is only said; `force` goes on mid-epoch too, saying what it costs.
    """
    saved = state.get("data") or {}
    if not saved or not now or saved == now or dataset is None:
        return  # a checkpoint from before this record, or no listing at all
    position = int(state["ranks"][0]["loader"]["position"])
    where = dataset.splits["train"].prefix.rstrip("/")
    change = f"{saved['train_samples']} samples at the checkpoint, {now['train_samples']} now" + (
        ", other files or labels" if saved["train_samples"] == now["train_samples"] else ""
    )
    epoch = int(state["epoch"])
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


def best_state(
    trainer: Trainer, recipe: Recipe, epoch: int, num_classes: int, class_names: list[str] | None = None
) -> dict[str, Any]:
    """What best.pt holds: the weights (and EMA) after `epoch`, its val top-1, the recipe.
    A checkpoint `stallfree eval` and `model.init_from` read; not one to resume from."""
    state = trainer.state_dict()
    return {
        "model": state["model"],
        **({"ema": state["ema"]} if "ema" in state else {}),
        "epoch": epoch,
        "step": trainer.optimizer_steps,
        "val_top1": trainer.best_val_top1,
        "recipe": recipe.to_dict(),
        "num_classes": num_classes,
        "class_names": list(class_names or []),
        "stallfree_version": __version__,
        "format": FORMAT,  # a new key: bump FORMAT and give older files its default there
    }


def restore(state: dict[str, Any], trainer: Trainer, loader: Loader, rank: int, device: torch.device) -> int:
    """Load a checkpoint into the trainer, loader and RNGs; return the epoch to continue: the
    loader's, the one place the epoch is kept (the checkpoint's top-level "epoch" is a copy of
    it for the checks that run before any loader exists).

    Under another world size the loader continues from the same global sample (positions are
    counted in samples of the epoch's order); a rank the checkpoint did not have keeps its
    freshly seeded RNGs. The same world size reopens each rank's log interval.
    """
    trainer.load_state_dict(state)
    ranks = state["ranks"]
    mine = ranks[rank] if rank < len(ranks) else None
    loader.load_state_dict((mine or ranks[0])["loader"])
    if mine is not None:
        set_rng_state(mine["rng"], device)
    if mine is not None and len(ranks) == trainer.dist.world_size:
        # Under another world size the interval's images were counted per rank of the old one:
        # it is dropped, and the next record covers the steps after the resume.
        trainer.load_interval_state(mine["interval"])
    return loader.epoch


def _root_named(root: str) -> str:
    """A local root resolved (a relative one names a folder from where it ran), a URL as is."""
    if not root:
        return ""
    return str(Path(root).resolve()) if storage.open(root).is_local else root


def _semantics(recipe: dict[str, Any], world_size: int) -> dict[str, Any]:
    train = recipe["train"]
    return {
        "global batch (train.batch_size x train.accum_steps x world size)": train["batch_size"]
        * train["accum_steps"]
        * world_size,
        "loader.backend": recipe["loader"]["backend"],
        "data.root": _root_named(recipe["data"]["root"]),
        "model.name": recipe["model"]["name"],
        "train.epochs": train["epochs"],  # the LR schedule's length
    }


def check_compatible(
    state: dict[str, Any], recipe: Recipe, world_size: int, path: Path, force: bool = False
) -> None:
    """Refuse to resume a run whose global batch, backend, data, model or epoch count differ.

    The micro-batch split and the world size may change as long as the global batch stays:
    positions are samples, so the resumed run continues on the next unseen sample. The epoch
    count lays out the LR schedule (warmup, then cosine to the last step): another count
    re-lays it mid-run, so the LR jumps (after a finished run, from near 0 back up); `force`
    accepts that, as it does the other differences.
    """
    if not resumable(state):
        raise ResumeError(
            f"cannot resume from {path}: it was written by stallfree "
            f"{state.get('stallfree_version', '< 0.2')}, which counted the loader "
            "position in batches, not samples; finish that run with the version "
            "that wrote it, or start this one in another --out"
        )
    saved = _semantics(state["recipe"], int(state["world_size"]))
    now = _semantics(recipe.to_dict(), world_size)
    diffs = [f"{key}: checkpoint {saved[key]!r}, now {now[key]!r}" for key in saved if saved[key] != now[key]]
    if diffs and not force:
        saved_epochs = state["recipe"]["train"]["epochs"]
        done = (
            f" That run had already finished ({saved_epochs} epochs)."
            if int(state["epoch"]) >= saved_epochs
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


def find_resume(resume: str, checkpointer: Checkpointer) -> ResumePoint | None:
    """`auto`: the newest checkpoint that loads (None if there is none); else the given file."""
    if resume == "auto":
        latest = checkpointer.load_latest()
        return ResumePoint(*latest) if latest is not None else None
    path = Path(resume)
    if path.name == LATEST and path.is_file():
        path = latest_target(path)  # the newest checkpoint, as eval, predict and export read it
    if path.is_dir():
        raise ResumeError(
            f"--resume {path} is a directory; pass a checkpoint file "
            f"({path}/checkpoints/ckpt-<step>.pt) or --resume auto with --out {path}"
        )
    state = load_checkpoint(path)
    others = [p for p in checkpointer.paths() if p.resolve() != path.resolve()]
    if others and path.resolve().parent != checkpointer.directory.resolve():
        raise ResumeError(
            f"{checkpointer.directory} already holds another run's checkpoints "
            f"({', '.join(p.name for p in others[:3])}); resume into an empty --out"
        )
    newer = [p.name for p in others if _step(p) > state["counters"]["optimizer_steps"]]
    if newer:
        raise ResumeError(
            f"{checkpointer.directory} holds checkpoints newer than {path.name} "
            f"({', '.join(newer)}): resuming would mix two histories; move them "
            "away first, or resume into another --out"
        )
    return ResumePoint(state, path)


def _step(path: Path) -> int:
    return int(path.stem.split("-")[1])
