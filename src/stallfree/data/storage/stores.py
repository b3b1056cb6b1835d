"""A location is a typed value: a `Store` (this machine's filesystem, or one bucket of an object
store) and a key in it. Text is parsed into one by `locate`, once, where it enters (data.root,
a command's argument); everything below takes the `Location`, and asks its store, never
"local or store?".
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import stallfree.data.storage.local as local
import stallfree.data.storage.objects as objects
from stallfree.data.storage.failures import NoDataError, NotAFolderError
from stallfree.data.storage.locations import scheme_of, split_url
from stallfree.data.storage.ranged import RangedFile

# The splits a folder root holds, and the fix a missing val/ is told.
FOLDER_SPLITS = ("train", "val")
VAL_FIX = "; or set data.val_fraction (e.g. 0.05) to hold out that share of train/ for validation"


class Store(Protocol):
    """Where bytes are kept, and how its keys are read (a key is a path, or an object's name)."""

    # Which readers read it (data/readers/factory.py): "local" walks folders itself, "object"
    # lists prefixes.
    kind: ClassVar[str]
    # Reader threads `loader.io_depth = "auto"` keeps in flight. The reads a loader needs in
    # flight are its rate times a read's latency: ~300 images/s a worker-core at 2 ms (a network
    # filesystem) is under 1, at 50 ms (an object store far away) 15, at the edge of 16
    # (benchmarks/RESULTS.md: at +50 ms, 16 left DALI's source 43-61 ms a batch, 64 under 1 ms).
    # A thread waiting on a socket costs no CPU; reads are bounded by the batches read ahead.
    reads_in_flight: ClassVar[int]

    @property
    def scheme(self) -> str:
        """The URL scheme ("s3", "gs", "az"); "" for this machine's filesystem."""
        ...

    def text(self, key: str) -> str:
        """The path or URL that names `key` (what a user writes, and a listing holds)."""
        ...

    def read(self, key: str, limit: int | None = None) -> bytes:
        """The bytes (at most `limit`)."""
        ...

    def read_range(self, key: str, start: int, length: int) -> bytes:
        """`length` bytes from byte `start`."""
        ...

    def size(self, key: str) -> int:
        """The size in bytes."""
        ...

    def exists(self, key: str) -> bool:
        """Whether a file or object is at `key` (a store's other errors raise)."""
        ...

    def list_objects(self, key: str, shallow: bool = False) -> dict[str, tuple[int, str]]:
        """{name relative to `key`: (size, version tag)} of everything under it, sorted by name
        (`shallow`: right under it only, as a listing with a delimiter); the tag changes when the
        file or object is replaced."""
        ...

    def list_dirs(self, key: str) -> list[str]:
        """The folders (common prefixes) right under `key`, sorted."""
        ...

    def identity(self, key: str) -> str:
        """A name for `key` that is the same wherever it is reached from (a cache's key, the
        data a checkpoint was trained on): a real path, or the store's endpoint and URL."""
        ...

    def resolve(self, key: str) -> str:
        """`key` as it names the same place from anywhere: a local path made absolute and its
        links followed; an object's key as is."""
        ...

    def check_root(self, key: str, fmt: str, val_optional: bool = False) -> None:
        """At start: `key` holds what a data root of format `fmt` needs (train/ and val/ for
        "folder", itself for any other; val/ may lack when `val_optional`); else one line
        naming it and the fix. In a store: the bucket exists, the credentials work and
        something is under each prefix."""
        ...

    def open(self, key: str, size: int | None = None) -> RangedFile | LocalFile:
        """A read-only, seekable file with `pread`, bounded in memory (`size`, when a listing
        gave it, spares a store the request that asks)."""
        ...

    def path(self, key: str) -> Path | None:
        """The path of `key` on this machine's filesystem; None in an object store."""
        ...

    def retries(self) -> int | None:
        """Requests this process retried in this kind of store; None where nothing is retried."""
        ...


class LocalFile(io.FileIO):
    """A local file, with the `pread` a RangedFile has."""

    def pread(self, length: int, offset: int) -> bytes:
        """`length` bytes from `offset` (fewer at the end); no position moved."""
        return os.pread(self.fileno(), length, offset)


def _missing_split(root: str, split: str) -> str:
    fix = VAL_FIX if split == "val" else ""
    return f"data.root {root} has no {split}/ folder; expected {root}/{split}/<class>/<image>{fix}"


@dataclass(frozen=True)
class LocalStore:
    """This machine's filesystem (a local disk or a mounted network filesystem)."""

    kind: ClassVar[str] = "local"
    reads_in_flight: ClassVar[int] = 16
    scheme: str = ""

    def text(self, key: str) -> str:
        return key

    def read(self, key: str, limit: int | None = None) -> bytes:
        return local.read(key, limit)

    def read_range(self, key: str, start: int, length: int) -> bytes:
        return local.read_range(key, start, length)

    def size(self, key: str) -> int:
        return local.size(key)

    def exists(self, key: str) -> bool:
        return local.exists(key)

    def list_objects(self, key: str, shallow: bool = False) -> dict[str, tuple[int, str]]:
        return local.list_objects(key, shallow)

    def list_dirs(self, key: str) -> list[str]:
        return local.list_dirs(key)

    def identity(self, key: str) -> str:
        return local.identity(key)

    def resolve(self, key: str) -> str:
        return os.path.realpath(key)

    def check_root(self, key: str, fmt: str, val_optional: bool = False) -> None:
        if os.path.isfile(key):
            raise NoDataError(
                f"data.root {key} is a file, not a folder; point it at the folder that holds it"
            )
        if not os.path.isdir(key):
            hint = " (run `stallfree data demo data/demo` to build the demo data)" if "demo" in key else ""
            raise NoDataError(f"data.root {key} does not exist{hint}")
        for split in FOLDER_SPLITS if fmt == "folder" else ():
            if not os.path.isdir(os.path.join(key, split)) and not (split == "val" and val_optional):
                raise NoDataError(_missing_split(key, split))

    def open(self, key: str, size: int | None = None) -> LocalFile:
        return LocalFile(key, "rb")

    def path(self, key: str) -> Path | None:
        return Path(key)

    def retries(self) -> int | None:
        return None


@dataclass(frozen=True)
class ObjectStore:
    """One bucket (an Azure container) of an object store, read with obstore (objects.py)."""

    kind: ClassVar[str] = "object"
    reads_in_flight: ClassVar[int] = 64
    scheme: str
    bucket: str

    def text(self, key: str) -> str:
        return f"{self.scheme}://{self.bucket}/{key}" if key else f"{self.scheme}://{self.bucket}"

    def read(self, key: str, limit: int | None = None) -> bytes:
        return objects.read(self.text(key), limit)

    def read_range(self, key: str, start: int, length: int) -> bytes:
        return objects.read_range(self.text(key), start, length)

    def size(self, key: str) -> int:
        return objects.size(self.text(key))

    def exists(self, key: str) -> bool:
        return objects.exists(self.text(key))

    def list_objects(self, key: str, shallow: bool = False) -> dict[str, tuple[int, str]]:
        return objects.list_objects(self.text(key), shallow)

    def list_dirs(self, key: str) -> list[str]:
        return objects.list_dirs(self.text(key))

    def identity(self, key: str) -> str:
        from stallfree.data.storage.settings import s3_endpoint

        endpoint = (s3_endpoint() or "aws") if self.scheme == "s3" else self.scheme
        return f"{endpoint}\0{self.text(key)}"

    def resolve(self, key: str) -> str:
        return key

    def check_root(self, key: str, fmt: str, val_optional: bool = False) -> None:
        for split in FOLDER_SPLITS if fmt == "folder" else ("",):
            objects.check_readable(self.text(f"{key}/{split}".strip("/") if split else key))

    def open(self, key: str, size: int | None = None) -> RangedFile:
        return RangedFile(self.text(key), self.size(key) if size is None else size)

    def path(self, key: str) -> Path | None:
        return None

    def retries(self) -> int | None:
        from stallfree.data.storage.settings import retries

        return retries()


@dataclass(frozen=True)
class Location:
    """A place data is at: a store and a key in it (a folder or prefix, a file or object).
    `str()` gives the path or URL it was parsed from, normalised (no trailing slash)."""

    store: Store
    key: str

    def __str__(self) -> str:
        return self.store.text(self.key)

    @property
    def name(self) -> str:
        """The last part of the key (a file's or object's own name)."""
        return self.key.rstrip("/").rpartition("/")[2]

    def join(self, *parts: str) -> Location:
        """The location `parts` below this one."""
        tail = "/".join(p.strip("/") for p in parts if p.strip("/"))
        if not tail:
            return self
        return Location(self.store, f"{self.key.rstrip('/')}/{tail}" if self.key else tail)

    def read(self, limit: int | None = None) -> bytes:
        """The bytes (at most `limit`)."""
        return self.store.read(self.key, limit)

    def read_range(self, start: int, length: int) -> bytes:
        """`length` bytes from byte `start` (one ranged GET from a store)."""
        return self.store.read_range(self.key, start, length)

    def size(self) -> int:
        """The size in bytes."""
        return self.store.size(self.key)

    def exists(self) -> bool:
        """Whether a file or object is here."""
        return self.store.exists(self.key)

    def list_objects(self, shallow: bool = False) -> dict[str, tuple[int, str]]:
        """{name relative to here: (size, version tag)} of everything under it (see Store.list_objects)."""
        return self.store.list_objects(self.key, shallow)

    def list_dirs(self) -> list[str]:
        """The folders (common prefixes) right under here, sorted."""
        return self.store.list_dirs(self.key)

    def identity(self) -> str:
        """A name for here that is the same wherever it is reached from (see Store.identity)."""
        return self.store.identity(self.key)

    def resolved(self) -> Location:
        """The same place named from anywhere: a local path absolute, its links followed."""
        return Location(self.store, self.store.resolve(self.key))

    def check_root(self, fmt: str = "", val_optional: bool = False) -> None:
        """The one check that a data root is there and holds what format `fmt` needs (a
        command makes it before torch is imported; the reader factory again, as it may be
        called alone: a few stat() calls, or a listing request a split)."""
        self.store.check_root(self.key, fmt, val_optional)

    def open(self, size: int | None = None) -> RangedFile | LocalFile:
        """A read-only, seekable file with `pread` (`size`: when a listing gave it)."""
        return self.store.open(self.key, size)

    @property
    def path(self) -> Path | None:
        """The path on this machine's filesystem; None for a location in an object store."""
        return self.store.path(self.key)

    def blocks(self, size: int = RangedFile.SPAN) -> Iterator[bytes]:
        """The bytes front to back, `size` at a time (bounded memory: a SHA-256 of a shard)."""
        with self.open() as f:
            while block := f.read(size):
                yield block

    def folder(self, why: str) -> Path:
        """The local folder this names; a NotAFolderError saying `why` (what needs one, and
        what to do instead) for a location in an object store."""
        if (path := self.path) is None:
            raise NotAFolderError(f"{self}: {why}")
        return path


def digest_of_listing(location: Location, listed: dict[str, tuple[int, str]]) -> str:
    """A digest of a listing's names, sizes and version tags: what changes when a file or
    object under `location` is added, replaced or removed."""
    digest = hashlib.sha256()
    prefix = f"{location.key}/" if location.key else ""
    for name, (size, tag) in listed.items():
        digest.update(f"{prefix}{name}\0{size}\0{tag}\n".encode())
    return digest.hexdigest()


LOCAL = LocalStore()  # the one filesystem: every local Location shares it


def locate(text: str | os.PathLike[str]) -> Location:
    """Parse a path or SCHEME://BUCKET/KEY into a Location: the one place text becomes one.
    An unknown scheme, or a URL without a bucket, is a StoreError naming it."""
    if not isinstance(text, str):
        return Location(LOCAL, str(Path(text)))
    if not scheme_of(text):
        return Location(LOCAL, str(Path(text)) if text else "")
    scheme, bucket, key = split_url(text)
    return Location(ObjectStore(scheme, bucket), key.strip("/"))
