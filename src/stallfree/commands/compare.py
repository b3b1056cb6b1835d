"""`stallfree compare`: several runs' summaries side by side, one line each."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from stallfree.data.registry import BACKENDS
from stallfree.errors import RunDirError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `stallfree compare` on the CLI's sub-parsers."""
    p = sub.add_parser("compare", help="several runs side by side: images/s, data-wait, accuracy")
    p.add_argument("runs", nargs="+", help="run directories holding summary.json")


def cmd_compare(args: argparse.Namespace) -> int:
    """Print one line per run directory; the exit code."""
    rows = []
    for run in args.runs:
        path = Path(run) / "summary.json"
        if not path.is_file():
            raise RunDirError(f"{path} not found; is {run} a finished run directory?")
        summary, recipe = json.loads(path.read_text()), _recipe(Path(run))
        backend = summary.get("backend", "?")
        rows.append((run, summary, _data_source(recipe), _strict(recipe, backend)))
    header = (
        f"{'run':<28} {'loader':<10} {'strict':<6} {'data':<13} {'img/s':>8} {'data-wait':>10} "
        f"{'val top-1':>10} {'wall s':>8}"
    )
    print(header)
    print("-" * len(header))
    for run, s, source, strict in rows:
        print(
            f"{Path(run).name:<28} {s.get('backend', '?'):<10} {strict:<6} {source:<13} "
            f"{format_figure('images_per_s', s.get('images_per_s')):>8} "
            f"{_percent(s.get('data_wait_frac')):>10} "
            f"{format_figure('val_top1', s.get('val_top1')):>10} "
            f"{format_figure('wall_s', s.get('wall_s')):>8}"
        )
    return 0


def _recipe(run: Path) -> dict[str, Any] | None:
    """The run's recipe.toml as read, or None when it is missing or not TOML."""
    from stallfree.recipe import tomllib

    try:
        return tomllib.loads((run / "recipe.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return None


def _strict(recipe: dict[str, Any] | None, backend: str) -> str:
    """Whether the run's torch loader decoded in full (`loader.torch.exact_decode`, the strict
    comparison with DALI): "on", "off", or "n/a" for a loader that it does not touch."""
    loader = (recipe or {}).get("loader", {})
    if backend in ("dali", "synthetic") or (
        backend == "synthetic-decode" and loader.get("synthetic_decode") == "dali"
    ):
        return "n/a"  # DALI decodes in full either way; synthetic decodes nothing
    if recipe is None:
        return "?"
    return "on" if loader.get("torch", {}).get("exact_decode", False) else "off"


def _data_source(recipe: dict[str, Any] | None) -> str:
    """Where a run read its data, from its recipe.toml: "s3 folders", "gs tar", "local tar", "synthetic"."""
    from stallfree.data import storage

    if recipe is None:
        return "?"
    data = recipe.get("data", {})
    backend = BACKENDS.get(recipe.get("loader", {}).get("backend", ""))
    root = str(data.get("root", ""))
    if not root or (backend is not None and not backend.needs_data):
        return "synthetic"
    try:
        where = storage.locate(root).store.scheme or "local"
    except storage.StoreError:
        where = "?"
    return f"{where} {'tar' if data.get('format') == 'tar' else 'folders'}"


# One format per figure, so that a column of `compare` lines up (and train's last line agrees).
_FORMATS = {"images_per_s": "{:.1f}", "data_wait_frac": "{:.4f}", "val_top1": "{:.4f}", "wall_s": "{:.1f}"}


def format_figure(key: str, value: object) -> str:
    """One summary figure as `compare` and train's last line print it."""
    if isinstance(value, float):
        return _FORMATS.get(key, "{:.4g}").format(value)
    return "-" if value is None else str(value)


def _percent(value: object) -> str:
    return f"{100 * value:.1f}%" if isinstance(value, float) else "-"
