"""One door to where data is: local paths and object stores (s3://, gs://, az://).

`locate(text)` parses a path or URL into a `Location` (its `Store` and a key; stores.py), once,
where the text enters; code that holds a root takes the Location. A sample's path in a listing
stays text (bytes per sample, not objects): the functions below take such a path and go through
its store. Stores are read with obstore (wire.py, clouds.py); retries, the outage
budget and errors are objects.py's. A sample's path may be a tar member reference (MemberRef).
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

from stallfree.data.storage.failures import (
    OUTAGE_ENV,
    NoDataError,
    NoSuchObjectError,
    NotAFolderError,
    ObjectGoneError,
    StoreError,
    StoreUnavailableError,
)
from stallfree.data.storage.locations import (
    MEMBER_SEP,
    MemberRef,
    base_name,
    member_path,
    scheme_of,
    split_url,
)
from stallfree.data.storage.ranged import RangedFile
from stallfree.data.storage.settings import (
    ATTEMPTS_ENV,
    ENDPOINT_ENV,
    attempt_timeout,
    configure,
    outage_budget,
    retries,
)
from stallfree.data.storage.stores import (
    LOCAL,
    LocalFile,
    LocalStore,
    Location,
    ObjectStore,
    Store,
    digest_of_listing,
    locate,
)
from stallfree.data.storage.wire import enable_direct

__all__ = [
    "ATTEMPTS_ENV", "ENDPOINT_ENV", "LocalFile", "LocalStore", "Location", "MEMBER_SEP",
    "MemberRef", "NoDataError", "NoSuchObjectError", "NotAFolderError", "OUTAGE_ENV",
    "ObjectGoneError", "ObjectStore", "RangedFile", "Store", "StoreError",
    "StoreUnavailableError", "attempt_timeout", "base_name", "configure", "digest_of",
    "digest_of_listing", "enable_direct", "endpoint_used", "file_path", "list_many", "locate",
    "member_path", "outage_budget", "read", "read_range", "read_sample", "retries", "size",
    "split_url",
]  # fmt: skip


def _store(location: str) -> tuple[Store, str]:
    """A sample path's store and key. Runs once a sample: a local path, already as a listing
    holds it, is taken as it is, not normalised as `locate` does (~4 us a call)."""
    if not scheme_of(location):
        return LOCAL, location
    place = locate(location)
    return place.store, place.key


def read(location: str, limit: int | None = None) -> bytes:
    """The file's or object's bytes (at most `limit`)."""
    store, key = _store(location)
    return store.read(key, limit)


def read_range(location: str, start: int, length: int) -> bytes:
    """`length` bytes from byte `start` (one ranged GET from a store)."""
    store, key = _store(location)
    return store.read_range(key, start, length)


def read_sample(path: str, limit: int | None = None) -> bytes:
    """A sample's bytes (at most `limit`): a file, an object, or a tar member read in place."""
    ref = MemberRef.parse(path)
    if ref is None:
        return read(path, limit)
    return read_range(ref.shard, ref.offset, ref.size if limit is None else min(ref.size, limit))


def size(location: str) -> int:
    """The size in bytes."""
    store, key = _store(location)
    return store.size(key)


def list_many(locations: list[Location], threads: int = 16) -> list[tuple[list[tuple[str, int]], str]]:
    """Everything under each location (class prefixes, say), `threads` listings in flight: for
    each, ([(name relative to it, size)], a digest of the names, sizes and version tags)."""

    def listed(location: Location) -> tuple[list[tuple[str, int]], str]:
        found = location.list_objects()
        return [(name, size) for name, (size, _) in found.items()], digest_of_listing(location, found)

    if len(locations) <= 1:
        return [listed(at) for at in locations]
    with ThreadPoolExecutor(min(threads, len(locations))) as pool:
        return list(pool.map(listed, locations))


def digest_of(parts: list[str]) -> str:
    """One digest of several listing digests (the class prefixes of a split)."""
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def endpoint_used(location: Location) -> str:
    """The endpoint URL a run from `location` reads from, to record with the run: "" for a
    local path or a cloud's own endpoint; no user or password part, never a credential."""
    if location.store.scheme != "s3":
        return ""
    from urllib.parse import urlsplit, urlunsplit

    from stallfree.data.storage.settings import s3_endpoint

    parts = urlsplit(s3_endpoint())
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", "")) if host else ""


def file_path(path: str) -> str | None:
    """`path` itself when a sample's bytes are a whole file on this machine (a decoder may open
    it by name), None for an object or a tar member."""
    return None if MemberRef.parse(path) is not None or scheme_of(path) else path
