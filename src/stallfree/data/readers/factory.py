"""Which reader lists a data root, chosen once from its format and its store's kind (as timm's
`create_reader`): the only place a reader is picked, so no reader asks where it reads from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from stallfree.data import storage
from stallfree.data.readers.listing import Dataset, DatasetError
from stallfree.data.readers.paths import data_root
from stallfree.recipe import DataConfig


@dataclass(frozen=True)
class Reader:
    """A way to list a root: `read(root, data, seed, reuse_listing)`, and whether it can hold
    out part of train/ as val (`data.val_fraction`)."""

    read: Callable[[storage.Location, DataConfig, int, bool], Dataset]
    holds_out: bool = False


def _folders(root: storage.Location, data: DataConfig, seed: int, reuse: bool) -> Dataset:
    from stallfree.data.readers.folders import read_folders

    return read_folders(root, data, seed, reuse)


def _store_folders(root: storage.Location, data: DataConfig, seed: int, reuse: bool) -> Dataset:
    from stallfree.data.readers.remote import read_store_folders

    return read_store_folders(root, data, seed, reuse)


def _shards(root: storage.Location, data: DataConfig, seed: int, reuse: bool) -> Dataset:
    """Ours (a root with a manifest) or other people's shards, each read in place."""
    from stallfree.data.readers.tarshards import MANIFEST, resolve_shards
    from stallfree.data.readers.webdataset import resolve_foreign

    return resolve_shards(root) if root.join(MANIFEST).exists() else resolve_foreign(root)


# (data.format, Store.kind) -> its reader.
READERS = {
    ("folder", storage.LocalStore.kind): Reader(_folders, holds_out=True),
    ("folder", storage.ObjectStore.kind): Reader(_store_folders),
    ("tar", storage.LocalStore.kind): Reader(_shards),
    ("tar", storage.ObjectStore.kind): Reader(_shards),
}


def reader_for(root: storage.Location, fmt: str) -> Reader:
    """The reader of a root of format `fmt` ("folder", "tar") in its store."""
    return READERS[(fmt, root.store.kind)]


def resolve_dataset(data: DataConfig, seed: int = 0, *, reuse_listing: bool = False) -> Dataset:
    """The recipe's data root listed once by its reader: the Dataset every backend, the bench
    and the trainer take. `seed` (train.seed) draws a held-out val; `reuse_listing` (a resume)
    takes a store root's cached listing (see data/readers/remote.py)."""
    if not data.root:
        raise DatasetError("data.root is empty; set it in the recipe or with --set data.root=PATH")
    root = data_root(data)
    reader = reader_for(root, data.format)
    if data.val_fraction and (not reader.holds_out or data.file_list):
        raise DatasetError(
            f"data.val_fraction = {data.val_fraction} holds out part of a local folder root's "
            "train/ (no data.file_list, data.format = folder); give this root a val split, or "
            "set data.val_fraction = 0"
        )
    root.check_root(data.format, val_optional=bool(data.val_fraction))
    return reader.read(root, data, seed, reuse_listing)
