"""`--loader synthetic-decode`: the real decode pipeline on a few real files held in memory.

The split's epoch keeps its length and sample order, but every sample is one of up to `_FILES`
of the split's files (a spread sample), copied into RAM (/dev/shm) at start, which the pipeline
(`loader.synthetic_decode`: torch, dali, or auto) decodes and augments as it would the real ones.
As fast as the real loader: the data path is decode-bound (CPU); much faster: storage (or the
page cache) is the stall. `synthetic` as fast as the bare model: the trainer does not stall.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from stallfree.data import storage
from stallfree.data.loader import Batch, Loader, LoaderSpec
from stallfree.data.readers.headers import read_bytes
from stallfree.data.readers.imageio import BadImageError, bad_headers, rules_id
from stallfree.data.readers.listing import Listing, ListingBuilder
from stallfree.data.registry import BackendError, ResolvedBackend

_FILES = 256


def in_memory_listing(listing: Listing, folder: str, files: int = _FILES) -> tuple[Listing, dict[str, str]]:
    """A listing as long as `listing` whose samples cycle over copies of a spread sample of
    its files, written into `folder` (a tmpfs); and each copy's original path."""
    picked = np.linspace(0, len(listing) - 1, num=min(files, len(listing))).astype(np.int64)
    picked = np.unique(picked)
    tails, originals = [], {}
    for n, i in enumerate(picked):
        path = listing.path(int(i))
        member = storage.base_name(path)
        ext = os.path.splitext(member)[1] or ".jpg"
        tail = f"{n:05d}{ext.lower()}"
        with open(os.path.join(folder, tail), "wb") as f:
            f.write(read_bytes(path))  # a tar member's bytes too
        tails.append(tail)
        originals[os.path.join(folder, tail)] = path
    builder = ListingBuilder(folder + os.sep, listing.classes)
    cycle = np.arange(len(listing)) % len(picked)
    builder.add([tails[k] for k in cycle], [int(listing.labels[picked[k]]) for k in cycle])
    return builder.build(), originals


class SyntheticDecodeLoader(Loader):
    """The chosen backend's loader over the in-memory listing; removes the copies on close."""

    def __init__(self, spec: LoaderSpec) -> None:
        if spec.listing is None or len(spec.listing) == 0:
            raise BackendError("synthetic-decode needs data.root: it decodes some of its files")
        # Its options are the backend it wraps, resolved with the run's ("auto" decided before).
        inner: ResolvedBackend = spec.options
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.folder = tempfile.mkdtemp(prefix="stallfree-synthetic-decode-", dir=shm)
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.folder, True)
        listing, self.originals = in_memory_listing(spec.listing, self.folder)
        # The copies' headers are checked here, once each: the listing then claims to be a
        # checked list, so the backend does not check the N samples that repeat them.
        bad = bad_headers(sorted(self.originals), spec.max_pixels)
        if bad:
            self.close()
            raise self._named(bad[0])
        inner_spec = dataclasses.replace(
            spec,
            listing=listing,
            sources=(self.folder,),
            checked_by=(rules_id(), spec.max_pixels),
            options=inner.options,
        )
        self.inner: Loader = inner.build(inner_spec)

    def _named(self, exc: BadImageError) -> BadImageError:
        """The error about a copy, about the user's file instead."""
        original = self.originals.get(exc.path)
        return BadImageError(original, exc.reason) if original else exc

    @property
    def epoch(self) -> int:
        return self.inner.epoch

    @property
    def position(self) -> int:
        return self.inner.position

    def __iter__(self) -> Iterator[Batch]:
        try:
            yield from self.inner
        except BadImageError as exc:
            raise self._named(exc) from None

    def __len__(self) -> int:
        return len(self.inner)

    def batches_left(self) -> int:
        return self.inner.batches_left()

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def close(self) -> None:
        inner = getattr(self, "inner", None)
        if inner is not None:
            inner.close()
        self._finalizer()


def build(spec: LoaderSpec) -> Loader:
    """Registry entry point for `--loader synthetic-decode`."""
    return SyntheticDecodeLoader(spec)
