"""The listing types: a split's `Listing` (stored as bytes rather than objects) and `Dataset`.

ImageNet-21k has 14.2M samples. As a tuple of (str, int) tuples that is ~1 KB a sample in every
process, and forked DataLoader workers copy it page by page as they touch reference counts
(copy-on-read). Here a split is three objects whatever its size: every path's tail in one
`bytes` buffer, their end offsets in one numpy array, the labels in another. A sample costs its
path's bytes plus 8 (4 for the offset, 4 for the label), and a fork shares all of it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from stallfree.errors import StallfreeError

SPLITS = ("train", "val")


class DatasetError(StallfreeError, ValueError):
    """A dataset folder that cannot be used; the message names the path and the fix."""


@dataclass(frozen=True, slots=True, eq=False)
class Listing:
    """Sample i is the file `prefix + tail(i)` with label `labels[i]`; classes name the labels.

    The prefix is shared (the split folder, or the shards' folder); the tails are relative
    paths, or tar member references ("SHARD.tar::MEMBER:OFFSET:SIZE").
    """

    prefix: str
    tails: bytes
    ends: np.ndarray  # ends[i]: where tail i ends in `tails` (uint32, int64 past 4 GiB)
    labels: np.ndarray  # int32
    classes: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.labels)

    def path(self, i: int) -> str:
        """The path (or tar member reference) of sample `i`."""
        start = int(self.ends[i - 1]) if i > 0 else 0
        return self.prefix + os.fsdecode(self.tails[start : int(self.ends[i])])

    def paths(self, ids: Iterable[int]) -> list[str]:
        """The paths of the samples `ids`, in that order."""
        return [self.path(int(i)) for i in ids]

    def iter_paths(self, start: int = 0, step: int = 1) -> Iterator[str]:
        """Every `step`-th path from `start` on, made one at a time (a rank's share, say)."""
        return (self.path(i) for i in range(start, len(self), step))

    @property
    def files(self) -> list[str]:
        """Every path as a list: for tools and tests on small data; loaders use `path(i)`."""
        return list(self.iter_paths())

    def digest(self, *, with_prefix: bool = True) -> str:
        """A hash of the samples and labels: equal listings, equal digests. Without the prefix,
        the same files and labels anywhere (a local copy, the store) hash alike."""
        h = hashlib.sha256(self.prefix.encode(errors="surrogateescape") if with_prefix else b"")
        for part in (
            self.tails,
            self.ends.astype(np.int64).tobytes(),
            self.labels.astype(np.int32).tobytes(),
            "\0".join(self.classes).encode(),
        ):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        return h.hexdigest()

    def subset(self, ids: np.ndarray) -> Listing:
        """The samples `ids`, in that order, under the same prefix and classes."""
        builder = ListingBuilder(self.prefix, self.classes)
        builder.add([self.path(int(i))[len(self.prefix) :] for i in ids], self.labels[ids].tolist())
        return builder.build()

    def nbytes(self) -> int:
        """Bytes held by the listing's three arrays."""
        return len(self.tails) + self.ends.nbytes + self.labels.nbytes


class ListingBuilder:
    """Collects tails and labels in chunks (one per class folder or shard), then packs them."""

    def __init__(self, prefix: str, classes: tuple[str, ...]) -> None:
        self.prefix, self.classes = prefix, classes
        self._tails: list[bytes] = []
        self._lengths: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []

    def add(self, tails: list[str], labels: int | list[int]) -> None:
        """Append `tails` with one label for all, or one label each."""
        encoded = [os.fsencode(t) for t in tails]
        self._tails.append(b"".join(encoded))
        self._lengths.append(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)))
        self._labels.append(
            np.full(len(encoded), labels, dtype=np.int32)
            if isinstance(labels, int)
            else np.asarray(labels, dtype=np.int32)
        )

    def __len__(self) -> int:
        return sum(len(labels) for labels in self._labels)

    def build(self) -> Listing:
        tails = b"".join(self._tails)
        ends = np.cumsum(np.concatenate(self._lengths)) if self._lengths else np.zeros(0, np.int64)
        ends = ends.astype(np.uint32 if len(tails) < 2**32 else np.int64)
        labels = np.concatenate(self._labels) if self._labels else np.zeros(0, np.int32)
        self._tails, self._lengths, self._labels = [], [], []
        return Listing(prefix=self.prefix, tails=tails, ends=ends, labels=labels, classes=self.classes)


@dataclass(frozen=True, slots=True)
class Dataset:
    """Listings of train and val under one label map (train's sorted class folders).

    `sources` are the folders (or shards) the listings were read from, whose modification
    times tell whether a cached header check still holds; `checked_by` is (version, max_pixels)
    when the listing is a `data check` clean list; `cached_listing`, on a resume that took its
    node's cached listing of a store, names it and how to list again (else "").
    """

    root: str
    classes: tuple[str, ...]
    splits: dict[str, Listing]
    sources: tuple[str, ...] = ()
    checked_by: tuple[str, int] | None = None
    cached_listing: str = ""

    @property
    def num_classes(self) -> int:
        return len(self.classes)


def hold_out(listing: Listing, fraction: float, seed: int) -> tuple[Listing, Listing]:
    """(train, val): `fraction` of each class's samples (rounded; at least one, never all of a
    class of two or more) drawn with (seed, label), so a class's draw does not move when other
    classes change. Both keep the listing's order."""
    held: list[np.ndarray] = []
    for label in np.unique(listing.labels).tolist():
        ids = np.flatnonzero(listing.labels == label)
        count = min(len(ids) - 1, max(1, round(fraction * len(ids))))
        rng = np.random.default_rng([seed % 2**32, label])
        held.append(rng.choice(ids, size=count, replace=False) if count > 0 else ids[:0])
    val = np.zeros(len(listing), dtype=bool)
    val[np.concatenate(held)] = True
    return listing.subset(np.flatnonzero(~val)), listing.subset(np.flatnonzero(val))
