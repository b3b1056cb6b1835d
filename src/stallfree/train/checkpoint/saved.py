"""A checkpoint as read from disk, with typed accessors: the one view of a saved checkpoint's
keys that code outside train/checkpoint/ has (resume checks, eval, export, predict, init_from)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stallfree.resolved import Resolved
from stallfree.train.checkpoint.files import load_checkpoint
from stallfree.train.checkpoint.format import resumable


@dataclass(frozen=True, slots=True)
class SavedCheckpoint:
    """A checkpoint (ckpt-<step>.pt or best.pt) at the current format, and its file.

    `state` is the dict of its parts: a run's `CheckpointManager` loads them from it; every other
    reader takes what it needs through the properties below.
    """

    state: dict[str, Any]
    path: Path

    @classmethod
    def read(cls, path: str | Path) -> SavedCheckpoint:
        """`load_checkpoint(path)`: weights-only, upgraded, refused when it is no checkpoint."""
        return cls(load_checkpoint(path), Path(path))

    @property
    def epoch(self) -> int:
        """The epoch a resumable checkpoint continues (its loader's: the one place it is kept);
        for a best.pt, the epoch its weights are from."""
        if "ranks" not in self.state:
            return int(self.state["epoch"])
        return int(self.state["ranks"][0]["loader"]["epoch"])

    @property
    def position(self) -> int:
        """The global sample of `epoch` a resumable checkpoint continues from (0: its start)."""
        return int(self.state["ranks"][0]["loader"]["position"])

    @property
    def optimizer_steps(self) -> int:
        """The optimizer steps taken when it was saved."""
        if "counters" not in self.state:  # a best.pt
            return int(self.state.get("step", 0))
        return int(self.state["counters"]["optimizer_steps"])

    @property
    def world_size(self) -> int:
        """The ranks of the run that saved it."""
        return int(self.state["world_size"])

    @property
    def resumable(self) -> bool:
        """Whether a run can continue from it (format 0's batch positions cannot be converted)."""
        return resumable(self.state)

    @property
    def version(self) -> str:
        """The stallfree that wrote it ("< 0.2" before versions were recorded)."""
        return str(self.state.get("stallfree_version", "< 0.2"))

    @property
    def metrics_records(self) -> int:
        """Lines of metrics.jsonl the run had written at the save (a resume cuts back to them)."""
        return int(self.state.get("metrics_records", 0))

    @property
    def data(self) -> dict[str, Any]:
        """train's sample count and digest (resume.data_record); {} when none was recorded."""
        return dict(self.state.get("data") or {})

    @property
    def has_recipe(self) -> bool:
        """False for a bare state dict: weights without a recipe."""
        return "recipe" in self.state

    @property
    def recipe(self) -> dict[str, Any]:
        """The recipe as the user gave it (its "auto" values unresolved)."""
        return dict(self.state["recipe"])

    @property
    def resolved(self) -> Resolved:
        """What the run's "auto" values became."""
        return Resolved.from_dict(self.state["resolved"], f"{self.path}'s resolved record")

    @property
    def recorded_num_classes(self) -> int:
        """The class count recorded at the save; 0 when none was."""
        return int(self.state.get("num_classes") or 0)

    @property
    def class_names(self) -> list[str]:
        """Each label's name as recorded, in label order ([] when none were)."""
        return [str(name) for name in self.state.get("class_names") or []]

    @property
    def has_ema(self) -> bool:
        """Whether it holds EMA weights (train.ema_decay was set)."""
        return "ema" in self.state

    def weights(self, *, ema: bool = False) -> dict[str, Any]:
        """The model's state dict, or its EMA copy's."""
        return dict(self.state["ema"]["module"] if ema else self.state["model"])


def model_weights(loaded: object) -> object:
    """What `torch.load` read from a weights file, as the model's state dict: a stallfree
    checkpoint's or best.pt's "model", anything else as it is (a plain state dict)."""
    if isinstance(loaded, dict) and isinstance(loaded.get("model"), dict):
        return loaded["model"]
    return loaded


def last_linear_rows(weights: dict[str, Any]) -> int | None:
    """The output count of the last 2-D weight (a classifier's classes); None without one."""
    found = [v for v in weights.values() if isinstance(v, torch.Tensor) and v.dim() == 2]
    return int(found[-1].shape[0]) if found else None
