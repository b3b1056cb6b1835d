"""Resume and preemption: what goes into a checkpoint, what must match, and SIGTERM handling."""

from __future__ import annotations

import signal
from pathlib import Path
from types import FrameType
from typing import Any

from stallfree import __version__
from stallfree.data.loader import Loader
from stallfree.recipe import Recipe
from stallfree.train.checkpoint import Checkpointer, load_checkpoint, rng_state, set_rng_state
from stallfree.train.distributed import gather_objects
from stallfree.train.trainer import Trainer

# EX_TEMPFAIL from sysexits.h: "try again later". A scheduler wrapper requeues on this code.
PREEMPTED_EXIT_CODE = 75


class ResumeError(ValueError):
    """A checkpoint whose run differs from this one in a way that changes its meaning."""


def training_state(trainer: Trainer, loader_state: dict[str, Any], recipe: Recipe,
                   world_size: int) -> dict[str, Any]:
    """Everything a resumed run needs to continue as if it had never stopped.

    Loader position (with DALI's reader and RNG checkpoint) and RNG states differ per rank, so
    every rank's are gathered; model, optimizer and schedule are the same on all ranks.
    """
    per_rank = gather_objects({"loader": loader_state, "rng": rng_state()}, world_size)
    return {
        **trainer.state_dict(),
        "ranks": per_rank,
        "epoch": int(loader_state["epoch"]),
        "recipe": recipe.to_dict(),
        "world_size": world_size,
        "stallfree_version": __version__,
    }


def restore(state: dict[str, Any], trainer: Trainer, loader: Loader, rank: int) -> int:
    """Load a checkpoint into the trainer, loader and RNGs; return the epoch to continue."""
    trainer.load_state_dict(state)
    mine = state["ranks"][rank % len(state["ranks"])]  # modulo only under --force
    loader.load_state_dict(mine["loader"])
    set_rng_state(mine["rng"])
    return int(state["epoch"])


def _semantics(recipe: dict[str, Any], world_size: int) -> dict[str, Any]:
    train = recipe["train"]
    return {
        "global batch (train.batch_size x train.accum_steps x world size)":
            train["batch_size"] * train["accum_steps"] * world_size,
        "world size": world_size,
        "loader.backend": recipe["loader"]["backend"],
        "data.root": str(Path(recipe["data"]["root"]).resolve()) if recipe["data"]["root"] else "",
        "model.name": recipe["model"]["name"],
    }


def check_compatible(state: dict[str, Any], recipe: Recipe, world_size: int, path: Path,
                     force: bool = False) -> None:
    """Refuse to resume a run whose global batch, world size, backend or data differ."""
    saved = _semantics(state["recipe"], int(state["world_size"]))
    now = _semantics(recipe.to_dict(), world_size)
    diffs = [f"{key}: checkpoint {saved[key]!r}, now {now[key]!r}"
             for key in saved if saved[key] != now[key]]
    if diffs and not force:
        raise ResumeError(f"cannot resume from {path}: the run differs in " + "; ".join(diffs)
                          + ". Restore those settings, or pass --force to resume anyway.")


def find_resume(resume: str, checkpointer: Checkpointer) -> tuple[dict[str, Any], Path] | None:
    """`auto`: the newest checkpoint that loads (None if there is none); else the given path."""
    if resume == "auto":
        return checkpointer.load_latest()
    return load_checkpoint(resume), Path(resume)


class StopSignal:
    """Turns SIGTERM and SIGUSR1 into a flag the trainer checks after each optimizer step."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True

    def __enter__(self) -> StopSignal:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
