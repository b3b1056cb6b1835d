"""Files on a local (or mounted network) filesystem, behind the same interface as a store's."""

from __future__ import annotations

import os


def read(path: str, limit: int | None = None) -> bytes:
    """The file's bytes (at most `limit`)."""
    with open(path, "rb") as f:
        return f.read() if limit is None else f.read(limit)


def read_range(path: str, start: int, length: int) -> bytes:
    """`length` bytes of the file from byte `start`."""
    with open(path, "rb") as f:
        return os.pread(f.fileno(), length, start)


def size(path: str) -> int:
    """The file's size in bytes."""
    return os.path.getsize(path)


def exists(path: str) -> bool:
    """Whether a file is at `path`."""
    return os.path.isfile(path)


def list_objects(path: str, shallow: bool = False) -> dict[str, tuple[int, str]]:
    """{name relative to the folder: (size, modification time)} of every file under it
    (`shallow`: right in it only), sorted by name as a store lists."""
    found: dict[str, tuple[int, str]] = {}
    base = path.rstrip("/") or "/"
    for folder, dirs, files in os.walk(base):
        dirs.sort()
        rel = os.path.relpath(folder, base)
        for name in files:
            path = os.path.join(folder, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:  # a dangling link: listed, and named when it is read
                st = os.lstat(path)
            found[name if rel == "." else f"{rel}/{name}"] = (st.st_size, str(st.st_mtime_ns))
        if shallow:
            break
    return dict(sorted(found.items()))


def list_dirs(path: str) -> list[str]:
    """The names of the folders right under `path`, sorted."""
    with os.scandir(path) as entries:
        return sorted(e.name for e in entries if e.is_dir())


def identity(path: str) -> str:
    """What names the file wherever it is reached from (a cache's key)."""
    return os.path.realpath(path)
