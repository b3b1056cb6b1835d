"""Resume: what goes into a checkpoint, and what must match for a run to continue from it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stallfree.data import storage
from stallfree.data.readers.listing import Dataset
from stallfree.errors import StallfreeError
from stallfree.log import LOGGER
from stallfree.recipe import Recipe
from stallfree.resolved import Resolved
from stallfree.train.checkpoint import LATEST, Checkpointer, ResumePoint, latest_target, load_checkpoint
from stallfree.train.ckpt_format import FORMAT, resumable
from stallfree.train.parts import PerRank, RngState, Stateful, load_parts, save_parts
from stallfree.train.prepare import RunContext
from stallfree.train.trainer import Trainer
from stallfree.version import __version__


class ResumeError(StallfreeError, ValueError):
    """A checkpoint whose run differs from this one in a way that changes its meaning."""


def saved_epoch(state: dict[str, Any]) -> int:
    """The epoch a checkpoint continues: its loader's, the one place the epoch is kept."""
    return int(state["ranks"][0]["loader"]["epoch"])


def saved_position(state: dict[str, Any]) -> int:
    """The global sample of `saved_epoch` a checkpoint continues from (0: the epoch's start)."""
    return int(state["ranks"][0]["loader"]["position"])


@dataclass(slots=True)
class RunCheckpoint:
    """A resumable checkpoint: the dict of its parts, each under its key (the trainer's parts,
    the segment clock, every rank's loader, RNGs and open log interval), and the facts that
    say which run it belongs to (the ones `check_compatible` and `check_same_data` compare,
    and what export and predict read: the class count and names)."""

    parts: dict[str, Stateful]
    facts: dict[str, Any]
    records: Callable[[], int]  # lines in metrics.jsonl: a resume cuts it back to them

    def state_dict(self) -> dict[str, Any]:
        return {
            **save_parts(self.parts),
            **self.facts,
            "metrics_records": self.records(),
            "stallfree_version": __version__,
            "format": FORMAT,  # a new key: bump FORMAT and give older files its default there
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_parts(state, self.parts)


def run_checkpoint(
    trainer: Trainer,
    loader: Stateful,
    clock: Stateful,
    ctx: RunContext,
    data: dict[str, Any],
) -> RunCheckpoint:
    """The checkpoint of a training run: `loader` is the train loader's part (the run's
    `StepMark`), `clock` the segment clock's, `data` the run's `data_record`."""
    dist = trainer.dist
    per_rank = PerRank(
        dist.rank,
        dist.world_size,
        positions={"loader": loader},
        own={"rng": RngState(ctx.device)},
        same_world={"interval": trainer.interval_part()},
    )
    facts = {
        "recipe": ctx.recipe.to_dict(),  # as given; what its "auto" values became is "resolved"
        "resolved": ctx.resolved.to_dict(),
        "num_classes": ctx.num_classes,  # what the model was built with (export reads it)
        "class_names": ctx.class_names,  # label order; predict and export.json read it
        "world_size": dist.world_size,
        "data": dict(data),
    }
    return RunCheckpoint(
        {**trainer.parts(), "segments": clock, "ranks": per_rank}, facts, lambda: trainer.sinks.records
    )


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
    cached = dataset.cached_listing if dataset is not None else ""
    if cached and saved == now:  # the claim checked: the checkpoint's positions count it
        LOGGER.info(f"resuming on {cached}, which the checkpoint's positions count")
    if not saved or not now or saved == now or dataset is None:
        return  # a checkpoint from before this record, or no listing at all
    position = saved_position(state)
    where = dataset.splits["train"].prefix.rstrip("/")
    change = f"{saved['train_samples']} samples at the checkpoint, {now['train_samples']} now" + (
        ", other files or labels" if saved["train_samples"] == now["train_samples"] else ""
    )
    if cached:  # this node's cached listing is not the checkpoint's: stale, the likely cause
        change += f"; this node resumed on {cached}, the likely cause"
    epoch = saved_epoch(state)
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


def best_state(trainer: Trainer, ctx: RunContext, epoch: int) -> dict[str, Any]:
    """What best.pt holds: the weights (and EMA) after `epoch`, its val top-1, the recipe.
    A checkpoint `stallfree eval` and `model.init_from` read; not one to resume from."""
    weights = {key: part for key, part in trainer.parts().items() if key in ("model", "ema")}
    return {
        **save_parts(weights),
        "epoch": epoch,
        "step": trainer.optimizer_steps,
        "val_top1": trainer.best_val_top1,
        "recipe": ctx.recipe.to_dict(),
        "resolved": ctx.resolved.to_dict(),
        "num_classes": ctx.num_classes,
        "class_names": ctx.class_names,
        "stallfree_version": __version__,
        "format": FORMAT,  # a new key: bump FORMAT and give older files its default there
    }


def _root_named(root: str) -> str:
    """A local root resolved (a relative one names a folder from where it ran), a URL as is."""
    if not root:
        return ""
    return str(Path(root).resolve()) if storage.open(root).is_local else root


def _semantics(recipe: dict[str, Any], resolved: dict[str, Any], world_size: int) -> dict[str, Any]:
    train = recipe["train"]
    return {
        "global batch (train.batch_size x train.accum_steps x world size)": train["batch_size"]
        * train["accum_steps"]
        * world_size,
        "loader.backend": resolved["backend"],  # the one that ran: "auto" decided
        "data.root": _root_named(recipe["data"]["root"]),
        "model.name": recipe["model"]["name"],
        "train.epochs": train["epochs"],  # the LR schedule's length
    }


def check_compatible(
    state: dict[str, Any],
    recipe: Recipe,
    resolved: Resolved,
    world_size: int,
    path: Path,
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
    if not resumable(state):
        raise ResumeError(
            f"cannot resume from {path}: it was written by stallfree "
            f"{state.get('stallfree_version', '< 0.2')}, which counted the loader "
            "position in batches, not samples; finish that run with the version "
            "that wrote it, or start this one in another --out"
        )
    saved = _semantics(state["recipe"], state["resolved"], int(state["world_size"]))
    now = _semantics(recipe.to_dict(), resolved.to_dict(), world_size)
    diffs = [f"{key}: checkpoint {saved[key]!r}, now {now[key]!r}" for key in saved if saved[key] != now[key]]
    if diffs and not force:
        saved_epochs = state["recipe"]["train"]["epochs"]
        done = (
            f" That run had already finished ({saved_epochs} epochs)."
            if saved_epoch(state) >= saved_epochs
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
