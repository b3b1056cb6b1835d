"""One door to where data is: local paths and object stores (s3://, gs://, az://).

`open(location)` gives the Source for a location, chosen once from its scheme (the only place
a scheme is read is locations.py); the functions below take a location (a path or a URL) and
go through its Source. Stores are read with obstore (wire.py, clouds.py); retries, the outage
budget and errors are objects.py's. A sample's path may be a tar member reference (MemberRef).
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType

import stallfree.data.storage.local as local
import stallfree.data.storage.objects as objects
from stallfree.data.storage.failures import (
    OUTAGE_ENV,
    NoSuchObjectError,
    ObjectGoneError,
    StoreError,
    StoreUnavailableError,
)
from stallfree.data.storage.locations import (
    MEMBER_SEP,
    MemberRef,
    base_name,
    join,
    member_path,
    scheme_of,
    split_url,
)
from stallfree.data.storage.settings import (
    ATTEMPTS_ENV,
    ENDPOINT_ENV,
    attempt_timeout,
    configure,
    outage_budget,
    retries,
)
from stallfree.data.storage.wire import enable_direct

__all__ = [
    "ATTEMPTS_ENV", "ENDPOINT_ENV", "MEMBER_SEP", "OUTAGE_ENV", "MemberRef", "NoSuchObjectError",
    "ObjectGoneError", "Source", "StoreError", "StoreUnavailableError", "attempt_timeout",
    "base_name", "check_readable", "check_root", "configure", "digest_of", "enable_direct",
    "endpoint_used", "endpoint_of", "exists", "identity", "join", "list_dirs", "list_many",
    "list_objects", "list_prefix", "member_path", "open", "outage_budget", "read", "read_range",
    "read_sample", "retries", "size", "split_url",
]  # fmt: skip


@dataclass(frozen=True)
class Source:
    """Where a location's bytes come from: `is_local` (a filesystem) or an object store
    (`scheme`: "s3", "gs", "az"); `ops` does the reads."""

    scheme: str
    ops: ModuleType

    @property
    def is_local(self) -> bool:
        """Whether the location is a path on this machine's filesystem."""
        return not self.scheme


_LOCAL = Source("", local)


def open(location: str | os.PathLike[str]) -> Source:
    """The Source of `location` (a local path, or SCHEME://BUCKET/KEY)."""
    scheme = scheme_of(location)
    return Source(scheme, objects) if scheme else _LOCAL


def read(location: str, limit: int | None = None) -> bytes:
    """The file's or object's bytes (at most `limit`)."""
    return open(location).ops.read(location, limit)


def read_range(location: str, start: int, length: int) -> bytes:
    """`length` bytes from byte `start` (one ranged GET from a store)."""
    return open(location).ops.read_range(location, start, length)


def read_sample(path: str, limit: int | None = None) -> bytes:
    """A sample's bytes (at most `limit`): a file, an object, or a tar member read in place."""
    ref = MemberRef.parse(path)
    if ref is None:
        return read(path, limit)
    return read_range(ref.shard, ref.offset, ref.size if limit is None else min(ref.size, limit))


def size(location: str) -> int:
    """The size in bytes."""
    return open(location).ops.size(location)


def exists(location: str) -> bool:
    """Whether a file or object is at `location` (a store's other errors raise)."""
    return open(location).ops.exists(location)


def list_objects(location: str, shallow: bool = False) -> dict[str, tuple[int, str]]:
    """{name relative to the folder or prefix: (size, version tag)} of everything under it
    (`shallow`: right under it only); the tag changes when the object is replaced."""
    return open(location).ops.list_objects(location, shallow)


def list_dirs(location: str) -> list[str]:
    """The folders (common prefixes) right under `location`, sorted."""
    return open(location).ops.list_dirs(location)


def list_prefix(url: str) -> tuple[list[tuple[str, int]], str]:
    """Every object under a store's prefix: ([(name, size)], digest of keys, sizes and tags)."""
    return objects.list_prefix(url)


def list_many(urls: list[str], threads: int = 16) -> list[tuple[list[tuple[str, int]], str]]:
    """`list_prefix` of each URL (class prefixes, say), `threads` listings in flight."""
    if len(urls) <= 1:
        return [list_prefix(u) for u in urls]
    with ThreadPoolExecutor(min(threads, len(urls))) as pool:
        return list(pool.map(list_prefix, urls))


def digest_of(parts: list[str]) -> str:
    """One digest of several listing digests (the class prefixes of a split)."""
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def identity(location: str) -> str:
    """A stable name for `location` (a cache's key): the real path of a file, the store's
    endpoint and URL of an object."""
    source = open(location)
    return local.identity(location) if source.is_local else f"{endpoint_of(location)}\0{location}"


def endpoint_of(location: str) -> str:
    """The endpoint the store of `location` is reached at ("" for a local path); never a
    credential. For S3: data.endpoint_url or AWS_ENDPOINT_URL, "aws" for AWS's own."""
    scheme = scheme_of(location)
    if scheme == "s3":
        from stallfree.data.storage.settings import s3_endpoint

        return s3_endpoint() or "aws"
    return scheme


def endpoint_used(location: str) -> str:
    """The endpoint URL a run from `location` reads from, to record with the run: "" for a
    local path or a cloud's own endpoint; no user or password part, never a credential."""
    if scheme_of(location) != "s3":
        return ""
    from urllib.parse import urlsplit, urlunsplit

    from stallfree.data.storage.settings import s3_endpoint

    parts = urlsplit(s3_endpoint())
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", "")) if host else ""


def check_readable(location: str) -> None:
    """At start: a store's bucket exists, the credentials work and something is under the
    prefix (a StoreError naming it otherwise); a local path: it exists."""
    if open(location).is_local:
        if not os.path.exists(location):
            raise StoreError(f"{location} does not exist")
        return
    objects.check_readable(location)


def check_root(root: str, fmt: str, endpoint_url: str = "") -> None:
    """`check_readable` on what a recipe's store root must hold (train/ and val/ for folders);
    nothing for a local root (the recipe's path check names it)."""
    if open(root).is_local:
        return
    configure(endpoint_url)
    for split in ("train", "val") if fmt == "folder" else ("",):
        check_readable(join(root, split) if split else root)
