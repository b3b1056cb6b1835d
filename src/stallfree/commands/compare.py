"""`stallfree compare`: several runs' summaries side by side, one line each."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

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
        rows.append((run, json.loads(path.read_text()), _data_source(Path(run))))
    header = (
        f"{'run':<28} {'loader':<10} {'data':<13} {'img/s':>8} {'data-wait':>10} {'val top-1':>10} "
        f"{'wall s':>8}"
    )
    print(header)
    print("-" * len(header))
    for run, s, source in rows:
        print(
            f"{Path(run).name:<28} {s.get('backend', '?'):<10} {source:<13} "
            f"{format_figure('images_per_s', s.get('images_per_s')):>8} "
            f"{_percent(s.get('data_wait_frac')):>10} "
            f"{format_figure('val_top1', s.get('val_top1')):>10} "
            f"{format_figure('wall_s', s.get('wall_s')):>8}"
        )
    return 0


def _data_source(run: Path) -> str:
    """Where a run read its data, from its recipe.toml: "s3 folders", "gs tar", "local tar", "synthetic"."""
    from stallfree.data import storage
    from stallfree.recipe import tomllib

    try:
        recipe = tomllib.loads((run / "recipe.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return "?"
    data, backend = recipe.get("data", {}), BACKENDS.get(recipe.get("loader", {}).get("backend", ""))
    root = str(data.get("root", ""))
    if not root or (backend is not None and not backend.needs_data):
        return "synthetic"
    try:
        where = storage.open(root).scheme or "local"
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
