"""Output folders the data tools write whole: staged beside their place, then renamed into it,
so that an interrupted run leaves no half-written folder where a complete one is expected."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def fresh_folder(parent: Path, prefix: str) -> Path:
    """A new, empty folder in `parent` named `prefix` and random letters, with the mode the
    umask gives (tempfile.mkdtemp's 0700 would keep others from reading what is renamed out)."""
    while True:
        path = parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            path.mkdir()
        except FileExistsError:
            continue  # 2**32 names: a clash is rare, and the next one is free
        return path


def move_into_place(staging: Path, out: Path) -> None:
    """Rename the finished `staging` folder to `out` (absent, or an empty folder)."""
    if out.is_dir():
        out.rmdir()  # empty (the caller checked): rename needs it gone
    os.rename(staging, out)
