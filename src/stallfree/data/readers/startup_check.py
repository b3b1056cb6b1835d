"""Start-up checks of a split, done once per dataset state and cached.

A run checks every header before its first step (a bad file must stop it then, not mid-epoch,
under either backend), which at ImageNet scale a requeued job would pay for at every start. So
the result is cached, keyed by what would change it (`_state_key`): the listing (names and
labels), the modification times of the folders or shards it was read from, the pixel limit and
this version's rules. `stallfree data check` is the full check.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

from stallfree.data import storage
from stallfree.data.readers.check_pool import check_headers, cpu_budget, decode_all
from stallfree.data.readers.imageio import BadImageError, rules_id
from stallfree.data.readers.listing import Listing
from stallfree.parallel import DistInfo
from stallfree.version import __version__


def cache_dir() -> Path:
    """Where check results are kept: $STALLFREE_CACHE, else $XDG_CACHE_HOME/stallfree."""
    base = os.environ.get("STALLFREE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "stallfree"
    )
    return Path(base)


def stat_key(paths: Iterable[str | Path], prefix: str = "") -> str:
    """A cache key from `prefix` and each path's size and modification time (a missing path
    counts as such): what changes when a file or a folder's entries change."""
    digest = hashlib.sha256(prefix.encode())
    for path in paths:
        try:
            st = os.stat(path)
            digest.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        except OSError:
            digest.update(f"{path}\0-\n".encode())
    return digest.hexdigest()[:32]


def _named(location: str) -> str:
    return str(storage.locate(location).resolved())


def _state_key(kind: str, listing: Listing, sources: tuple[str, ...], max_pixels: int) -> str:
    # Resolved paths: a relative data.root names another dataset in another folder, and a
    # copy of the tree keeps the times that the key reads (cp -a, rsync -a, copytree).
    # An object-store URL is itself (its sources carry a digest of the listed keys and ETags).
    # A file rewritten in place leaves its folder's time alone, but stat()ing every file would
    # cost a start on a network file system what the cache saves: such a file is met when its
    # batch comes (both loaders check each header as they read it, and raise or skip it).
    where = _named(listing.prefix)
    return stat_key(
        [_named(s) for s in sources],
        f"{kind} {rules_id()} {max_pixels} {where} {listing.digest()}",
    )


def write_cache_file(path: Path, text: str | bytes) -> OSError | None:
    """Write a cache file atomically (temp file, rename); the error, if it could not be."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        if isinstance(text, bytes):
            tmp.write_bytes(text)
        else:
            tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        return exc
    return None


def _entry_digest(key: str, bad: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps([__version__, key, bad], sort_keys=True).encode()).hexdigest()


_warned: set[Path] = set()


def _read_cache(path: Path, key: str) -> dict[str, str] | None:
    """The cached {path: reason}, or None (check again): absent, or not as `_write_cache` wrote
    it for `key` (an older version's, edited, damaged), which is ignored with a warning."""
    try:
        entry = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        entry = None
    bad = entry.get("bad") if isinstance(entry, dict) else None
    if (
        isinstance(bad, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in bad.items())
        and entry.get("digest") == _entry_digest(key, bad)
    ):
        return bad
    if path not in _warned:  # once a process: the train and val loaders may both read it
        _warned.add(path)
        warnings.warn(
            f"check cache {path} is not as stallfree {__version__} wrote it: ignored, "
            "the files are checked again",
            stacklevel=3,
        )
    return None


def _write_cache(path: Path, key: str, bad: dict[str, str]) -> None:
    """Keep the result for the next start; a cache that cannot be written only costs time."""
    entry = {"version": __version__, "bad": bad, "digest": _entry_digest(key, bad)}
    exc = write_cache_file(path, json.dumps(entry))
    if exc is not None:
        warnings.warn(
            f"cannot write the check cache {path} ({exc.strerror or exc}): the next "
            "start checks again; set STALLFREE_CACHE to a writable folder",
            stacklevel=3,
        )


def cached_check(kind: str, key: str, check: Callable[[], object]) -> None:
    """Run `check` (which raises on a problem) once per `key`: a marker file remembers a pass."""
    text = f"{kind} {__version__} {key}\n"
    marker = cache_dir() / f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:32]}.ok"
    try:
        if marker.read_text() == text:  # holds what was written: not a stray or edited file
            return
    except (OSError, ValueError):
        pass  # absent or unreadable: check
    check()
    write_cache_file(marker, text)  # an error only costs the next start the same check


def _gathered(bad: dict[str, str], dist: DistInfo) -> dict[str, str] | None:
    """Every rank's findings merged, or None when ranks cannot talk (no process group)."""
    if dist.world_size <= 1:
        return bad
    import torch.distributed as torch_dist

    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        return None
    parts: list[dict[str, str] | None] = [None] * dist.world_size
    torch_dist.all_gather_object(parts, bad)
    return {path: reason for part in parts for path, reason in (part or {}).items()}


def bad_headers_at_start(
    listing: Listing,
    *,
    sources: tuple[str, ...],
    checked_by: tuple[str, int] | None,
    max_pixels: int,
    dist: DistInfo,
) -> list[BadImageError]:
    """The split's files whose header is bad (all ranks', so every rank decides alike).

    Each rank checks its share, in worker interpreters on its share of the node's cores; the
    result is cached per dataset state, so the next start (a requeue, the next run) skips the
    check. A `data check` clean list of this version and
    pixel limit (`checked_by`) needs no check at all, for the root it was written for.
    """
    if checked_by == (rules_id(), max_pixels):
        return []  # a data check clean list: every file was fully decoded under these rules
    key = _state_key("headers", listing, sources, max_pixels)
    cache = cache_dir() / f"headers-{key}.json"
    bad = _read_cache(cache, key)
    if bad is None:
        share = listing.iter_paths(dist.rank, dist.world_size)
        count = len(range(dist.rank, len(listing), dist.world_size))
        workers = cpu_budget(dist.local_world_size)
        progress = dist.rank == 0 and count >= 100_000
        found = dict(check_headers(share, count, max_pixels, workers, progress=progress))
        bad = _gathered(found, dist)
        if bad is None:  # several ranks without a process group: each knows its own share
            bad = found
        elif dist.rank == 0:
            _write_cache(cache, key, bad)
    return [BadImageError(path, reason) for path, reason in bad.items()]


def cached_bad_files(
    listing: Listing,
    *,
    sources: tuple[str, ...],
    max_pixels: int,
    workers: int,
    dist: DistInfo,
    progress: bool = True,
) -> dict[str, str]:
    """{path: reason} for the files of the split that do not fully decode, checked once and
    cached (data.on_error = skip under dali). Every rank gets the same answer."""
    key = _state_key("decode", listing, sources, max_pixels)
    cache = cache_dir() / f"decode-{key}.json"
    bad = _read_cache(cache, key)
    if bad is not None:
        return bad
    share = list(listing.iter_paths(dist.rank, dist.world_size))
    reasons = decode_all(
        share,
        max_pixels,
        workers,
        desc="checking images (data.on_error = skip)",
        progress=progress and dist.rank == 0 and len(share) >= 10_000,
    )
    bad = _gathered({p: r for p, r in zip(share, reasons) if r}, dist)
    if bad is None:
        raise RuntimeError("data.on_error = skip with several ranks needs the process group")
    if dist.rank == 0:
        _write_cache(cache, key, bad)
    return bad
