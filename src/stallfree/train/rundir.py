"""The run directory: one run's recipe (as given) and what its "auto" values became, metrics,
summary, checkpoints and preemption marker.

A directory belongs to one run. A fresh start never reuses another run's checkpoints or appends
to its metrics; `--resume` is the only way to continue one, and it first cuts metrics.jsonl back
to the records that the resumed checkpoint had seen, so no step is logged twice.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from stallfree.errors import RunDirError
from stallfree.metrics import write_json_atomic
from stallfree.resolved import RESOLVED

RECIPE, METRICS, SUMMARY = "recipe.toml", "metrics.jsonl", "summary.json"
CHECKPOINTS = "checkpoints"
# Written when a run stops on SIGTERM/SIGUSR1 after saving; removed when the next run starts.
# A requeue loop around torchrun (which exits 1 whatever its workers returned) checks for it.
PREEMPTED = "preempted.json"


class RunDir:
    """Paths of one run directory and the rules for starting in it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise RunDirError(f"--out {self.path} is a file; pass a directory for the run")
        self.checkpoints = self.path / CHECKPOINTS

    def check_writable(self) -> None:
        """Fail now, not after an epoch, when the directory cannot be created or written."""
        probe = self.path
        while not probe.exists():
            probe = probe.parent
        try:  # a real write: permission bits say nothing to root or on read-only mounts
            with tempfile.TemporaryFile(dir=probe):
                pass
        except OSError as exc:
            raise RunDirError(
                f"--out {self.path}: cannot write in {probe} ({exc.strerror}); choose another --out"
            ) from exc

    def artifacts(self) -> list[Path]:
        """What an earlier run left here: checkpoints, metrics, summary."""
        found = sorted(self.checkpoints.glob("ckpt-*.pt")) if self.checkpoints.is_dir() else []
        return found + [p for p in (self.path / METRICS, self.path / SUMMARY) if p.exists()]

    def check_fresh_start(self, resume: str | None) -> None:
        """Refuse a fresh start over another run's files (with `--resume auto` and no checkpoint
        yet, the same run restarts from scratch: its partial metrics are replaced)."""
        left = self.artifacts()
        checkpoints = [p for p in left if p.suffix == ".pt"]
        if resume == "auto" and not checkpoints:
            return
        if left:
            names = ", ".join(p.name for p in left[-4:])
            what = "checkpoints that do not load" if resume == "auto" else "another run's files"
            raise RunDirError(
                f"--out {self.path} holds {what} ({names}); continue that run with "
                f"--resume auto, or start this one in another --out directory"
            )

    def start(self, recipe_toml: str, resolved_toml: str, metrics_records: int) -> None:
        """Rank 0, once every check has passed: write the recipe and the Resolved record, cut
        metrics back to the records the resumed checkpoint had seen (0 for a fresh start),
        clear the marker."""
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / RECIPE).write_text(recipe_toml)
        (self.path / RESOLVED).write_text(resolved_toml)
        _truncate_lines(self.path / METRICS, metrics_records)
        (self.path / PREEMPTED).unlink(missing_ok=True)

    def clear_preempted(self) -> None:
        """Remove an earlier run's marker (if the directory can be written at all)."""
        try:
            (self.path / PREEMPTED).unlink(missing_ok=True)
        except OSError:
            pass  # an unwritable --out is reported by check_writable, in one line

    def mark_preempted(self, info: dict[str, Any]) -> None:
        """Leave the marker that a requeue loop looks for."""
        write_json_atomic(self.path / PREEMPTED, info)

    def finished_summary(self) -> dict[str, Any]:
        """summary.json of a finished run; rebuilt from metrics.jsonl when it was lost (a run
        killed between its last checkpoint and the summary), and written back."""
        path = self.path / SUMMARY
        if path.is_file():
            return json.loads(path.read_text())
        summary = summary_from_metrics(self.path / METRICS)
        write_json_atomic(path, summary)
        return summary


def summary_from_metrics(path: Path) -> dict[str, Any]:
    """The figures of summary.json from a run's metrics.jsonl: throughput and data-wait over all
    its intervals, the last validation, the step counts."""
    records = (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    )
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_top1" in r]
    summary: dict[str, Any] = {"images_per_s": None, "data_wait_frac": None, "rebuilt_from": METRICS}
    timed = [r for r in train if "interval_s" in r and r["interval_s"]]
    if timed:
        wall = sum(r["interval_s"] for r in timed)
        summary["images_per_s"] = sum(r["images"] for r in timed) / wall
        summary["data_wait_frac"] = sum(r["data_wait_frac"] * r["interval_s"] for r in timed) / wall
    elif train:  # written before intervals carried their length: an unweighted mean
        summary["images_per_s"] = sum(r["images_per_s"] for r in train) / len(train)
        summary["data_wait_frac"] = sum(r["data_wait_frac"] for r in train) / len(train)
    if train:
        summary.update(optimizer_steps=train[-1]["step"], skipped_steps=train[-1]["skipped_steps"])
    if val:
        summary.update({k: v for k, v in val[-1].items() if k.startswith("val_")})
    return summary


def _truncate_lines(path: Path, keep: int) -> None:
    """Keep the first `keep` lines of `path` (atomically); none -> an empty file."""
    lines = path.read_text().splitlines(keepends=True)[:keep] if path.exists() and keep else []
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(lines))
    os.replace(tmp, path)
