"""The checkpoint format number, and `upgrade`: the one place an older file is brought up to it.

Every checkpoint (ckpt-<step>.pt, best.pt) carries `"format": FORMAT` and `load_checkpoint`
passes every file through `upgrade`, so the code that reads one finds every key of the current
format and never guesses a file's age from which keys exist. To add a key: write it in the part
that owns it (its state_dict), bump FORMAT, and add a `_to_<N>` step that gives files of format
N-1 the key's default (the value that means what a file without it meant).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from stallfree.errors import StallfreeError
from stallfree.recipe import lift_requested
from stallfree.resolved import resolved_of_old_recipe
from stallfree.version import __version__

# Each `_to_<N>` below says what format N brought; formats 0 and 1 are unstamped (`format_of`).
FORMAT = 6


class CheckpointFormatError(StallfreeError, ValueError):
    """A checkpoint written in a format newer than this stallfree reads."""


def format_of(state: dict[str, Any]) -> int:
    """The file's format: its stamp, or for unstamped files the only guess. Format 0 is
    stallfree 0.1's (loader positions in batches: its weights still load for eval, export and
    init_from, a resume is refused, `resumable`); format 1 is 0.2-0.3's (positions in samples)."""
    if "format" in state:
        return int(state["format"])
    loaders = [rank["loader"] for rank in state.get("ranks", [])]
    return 0 if any("batch_size" not in loader for loader in loaders) else 1


def resumable(state: dict[str, Any]) -> bool:
    """Whether an upgraded state can be resumed from (format 0 positions cannot be converted)."""
    return int(state.get("upgraded_from", FORMAT)) >= 1


def upgrade(state: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """`state` (read from `path`) at the current FORMAT, upgraded one format at a time.

    A newer format than this code knows is refused: its keys may mean what this code cannot.
    """
    found = format_of(state)
    if found > FORMAT:
        raise CheckpointFormatError(
            f"checkpoint {path} is format {found}, newer than this stallfree {__version__} "
            f"reads (format {FORMAT}); upgrade stallfree (pip install -U stallfree)"
        )
    for version in range(found + 1, FORMAT + 1):
        state = _STEPS[version](state)
    if found < FORMAT:
        state["upgraded_from"] = found
    state["format"] = FORMAT
    return state


def _to_1(state: dict[str, Any]) -> dict[str, Any]:
    """Format 1 (0.2-0.3, unstamped): loader positions in samples."""
    # Batch positions cannot become sample positions (0.1's order differs): the loader state
    # is left as it is, and `resumable` says no.
    return state


def _to_2(state: dict[str, Any]) -> dict[str, Any]:
    """Format 2: stamped with "format"; every key 0.2-0.3 added without a stamp is present
    (counters.best_val_top1 from 0.3, totals and segments, num_classes, class_names)."""
    state.setdefault("num_classes", 0)  # 0: export reads the class count from the weights
    state.setdefault("class_names", [])  # none recorded: export and predict name labels by number
    if "counters" not in state:  # a best.pt: weights, epoch and recipe only
        return state
    counters = state["counters"]
    counters.setdefault("best_val_top1", -1.0)  # absent before 0.3: no epoch compared yet
    counters.pop("epoch", None)  # 0.2 kept it here; the loader's state holds it
    # Absent in older files: zero earlier time, so the summary counts the later segments only.
    state.setdefault("totals", {"images": 0, "wall_s": 0.0, "wait_s": 0.0})
    state.setdefault("segments", {"wall_s": 0.0, "count": 0})
    state.setdefault("metrics_records", 0)  # 0: metrics.jsonl restarts (what 0.2 did)
    for rank in state.get("ranks", []):
        rank["loader"].pop("dali_list_start", None)  # 0.2's; its random state goes in _to_4
    return state


def _to_3(state: dict[str, Any]) -> dict[str, Any]:
    """Format 3: "data", train's sample count and a digest of its files and labels (a mid-epoch
    resume on other data is refused); {} in older files: nothing to compare."""
    if "counters" in state:  # a best.pt has no resume point to check
        state.setdefault("data", {})  # not recorded: a resume compares nothing
    return state


def _to_4(state: dict[str, Any]) -> dict[str, Any]:
    """Format 4: each rank's "interval", the open log interval's sums, counts and seconds (a
    resume between two records goes on with it). A loader's state is its positions alone: every
    sample's augmentation comes from its own seed, so a backend's random state ("dali") goes."""
    empty = {"loss_sum": 0.0, "grad_norm_sum": 0.0, "samples": 0, "steps": 0, "wall_s": 0.0, "wait_s": 0.0}
    for rank in state.get("ranks", []):
        rank.setdefault("interval", dict(empty))  # not kept: the next record starts afresh
        rank["loader"].pop("dali", None)  # the draws it continued now come from sample seeds
    return state


def _to_5(state: dict[str, Any]) -> dict[str, Any]:
    """Format 5: the epoch is kept once, in each rank's loader state; the top-level copy goes
    (a best.pt keeps its "epoch": the epoch its weights are from)."""
    if "counters" in state:  # a resumable file: its loader states hold the epoch
        state.pop("epoch", None)
    return state


def _to_6(state: dict[str, Any]) -> dict[str, Any]:
    """Format 6: "recipe" as the user gave it, and "resolved", what its "auto" values became
    (stallfree.resolved). Older recipes held those values, `<key>_requested = "auto"` beside."""
    if "recipe" in state:  # a bare state dict has neither
        chosen = lift_requested(state["recipe"])
        state["resolved"] = resolved_of_old_recipe(state["recipe"], chosen)
    return state


_STEPS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {
    1: _to_1,
    2: _to_2,
    3: _to_3,
    4: _to_4,
    5: _to_5,
    6: _to_6,
}
