"""The `torch` backend: a tuned PyTorch DataLoader.

Decode (libjpeg-turbo via simplejpeg, else PIL) and uint8 augmentation in worker processes.
On a GPU run: a uint8 collate, pinned memory, and normalisation on the device in a prefetcher
that overlaps the next copy with compute. On a CPU run: normalised in the workers.
"""

from __future__ import annotations

import inspect
import itertools
import signal
import sys
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from functools import partial
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from stallfree.data.backends.prefetch import DevicePrefetcher, NormalisingCollate, collate_uint8
from stallfree.data.loader import Batch, Loader, LoaderSpec, ShardedLoader
from stallfree.data.readers.headers import read_bytes
from stallfree.data.readers.imageio import BadImageError
from stallfree.data.readers.inflight import ReaderPool, reads_in_flight
from stallfree.data.readers.listing import Listing
from stallfree.data.registry import BackendError
from stallfree.data.sharding import sample_seeds
from stallfree.data.storage import StoreError
from stallfree.data.transforms.augment import train_transform, val_transform
from stallfree.errors import some_of
from stallfree.parallel import cpu_workers
from stallfree.recipe import AugmentConfig, TorchLoaderConfig

# The worker count is the user's or measured (workers = "auto" tries one more than the cores):
# torch's advice to use fewer than the CPUs it counts is noise in either case.
warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)

# (path, augmentation spec, this epoch's crop side, per-sample seed, max pixels) -> one
# decoded, augmented sample
Transform = Callable[[str, AugmentConfig, int, int, int], Any]
Collate = Callable[[list[Any]], tuple[torch.Tensor, torch.Tensor]]


class ImageDataset(Dataset):
    """Index by (sample id, augmentation seed, crop size) so augmentation is independent of
    worker layout, and the size follows the epoch's (persistent workers hold their own copy of
    this object: the size travels with each key)."""

    def __init__(
        self, listing: Listing, transform: Transform, aug: AugmentConfig, max_pixels: int, io_depth: int = 1
    ) -> None:
        # The listing is three objects (data/readers/listing.py): forked workers share it, page for page.
        self.listing, self.transform, self.aug, self.max_pixels = listing, transform, aug, max_pixels
        # A transform that takes the bytes (`data=`) gets a batch's files read io_depth at a
        # time by this worker's reader threads; any other reads its own, one at a time.
        takes_bytes = "data" in inspect.signature(transform).parameters
        self.readers = ReaderPool(io_depth) if takes_bytes and io_depth > 1 else None
        # This worker's next batch's reads, started behind the current batch's (its sample ids
        # come with the keys: `Keys.next_batch_ids`), so that no batch starts with a store's
        # whole latency.
        self._ahead: dict[str, Future[bytes]] = {}

    def __len__(self) -> int:
        return len(self.listing)

    def __getitem__(self, key: tuple[int, int, int]) -> tuple[Any, int]:
        return self._sample(key, self.listing.path(key[0]), None)

    def __getitems__(self, keys: list[tuple[int, int, int]]) -> list[tuple[Any, int]]:
        """A batch's samples, in order: its files read concurrently, each decoded from its
        bytes as soon as they (and those before it) are in, while the rest are in flight."""
        if self.readers is None:
            return [self[key] for key in keys]
        paths = [self.listing.path(index) for index, _, _ in keys]
        pool = self.readers.get()
        ahead, self._ahead = self._ahead, {}
        reads = [ahead.pop(path) if path in ahead else pool.submit(read_bytes, path) for path in paths]
        for read in ahead.values():  # read for a batch that went elsewhere (an epoch's end)
            read.cancel()
        for index in getattr(keys, "next_batch_ids", ()):
            path = self.listing.path(index)
            self._ahead[path] = pool.submit(read_bytes, path)
        try:
            return [self._sample(key, path, _read(read)) for key, path, read in zip(keys, paths, reads)]
        finally:
            for read in reads:  # after an error: the batch's reads not started yet
                read.cancel()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_ahead": {}}  # futures stay in the process that made them

    def _sample(self, key: tuple[int, int, int], path: str, data: bytes | None) -> tuple[Any, int]:
        index, seed, size = key
        label = int(self.listing.labels[index])
        try:
            if data is None:
                return self.transform(path, self.aug, size, seed, self.max_pixels), label
            return self.transform(path, self.aug, size, seed, self.max_pixels, data=data), label  # type: ignore[call-arg]
        except BadImageError as exc:
            # Returned, not raised: a raise would reach the user as a worker traceback.
            return BadSample(exc.path, exc.reason), label


def _read(read: Future[bytes]) -> bytes | None:
    """A read's bytes; None when it failed: the transform then opens the path itself and names
    the file and the reason, exactly as without reads in flight."""
    try:
        return read.result()
    except StoreError:
        raise  # final (retries and the outage budget spent) and names the object: no second try
    except Exception:  # noqa: BLE001 - reported by the transform's own read
        return None


class Keys(list):
    """A batch's keys, and `next_batch_ids`: the sample ids of the batch that the same worker
    gets next (the DataLoader deals batches to its workers in turn), whose reads it starts early."""

    next_batch_ids: list[int]


class _LoaderSampler(Sampler[list[tuple[int, int, int]]]):
    """The loader's remaining batches as lists of (sample id, augmentation seed, crop size)."""

    def __init__(self, loader: ShardedLoader) -> None:
        # A proxy: the DataLoader must not keep its TorchLoader alive, or the loader's
        # finaliser (which shuts the workers down) could only run at exit.
        self.loader = weakref.proxy(loader)

    def __len__(self) -> int:
        return self.loader.batches_left()

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        order, base = self.loader.epoch_order()  # once: a permutation is 4 bytes a sample
        size = self.loader.spec.crop_size(self.loader.epoch)
        # Batch j goes to worker j % workers, whose next one is batch j + workers.
        workers = max(1, self.loader.dataloader.num_workers)
        batches = self.loader.plan.batches(order, self.loader.position)
        window: deque[np.ndarray] = deque(itertools.islice(batches, workers))
        while window:
            ids = window.popleft()
            keys = Keys((i, seed, size) for i, seed in zip(ids.tolist(), sample_seeds(base, ids).tolist()))
            following = next(batches, None)
            keys.next_batch_ids = [] if following is None else following.tolist()
            if following is not None:
                window.append(following)
            yield keys


def _worker_init(_: int) -> None:
    # Each worker decodes one image at a time; intra-op threads would only oversubscribe cores.
    torch.set_num_threads(1)
    # A scheduler signals the whole process group. The main process finishes the step, saves
    # and shuts the workers down itself; a worker killed by SIGTERM first would end the run
    # with "DataLoader worker is killed by signal" and no checkpoint.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


def shutdown_workers(dataloader: DataLoader) -> None:
    """Stop persistent workers now. Dropping the iterator is not enough when a generator that
    was left mid-epoch still holds it: its workers would die only at interpreter exit.

    Workers ignore SIGTERM (see `_worker_init`), so the DataLoader's own last resort,
    `terminate()`, would not end one that did not stop when asked, and multiprocessing's exit
    handler would then wait for it forever: such a worker is killed.
    """
    iterator = dataloader._iterator  # noqa: SLF001 - DataLoader has no public shutdown
    workers = list(getattr(iterator, "_workers", []))
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()  # noqa: SLF001
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            worker.join(timeout=5)
    dataloader._iterator = None  # noqa: SLF001


class TorchLoader(ShardedLoader):
    """DataLoader adapter that yields `Batch` on the device and resumes mid-epoch.

    `transform`, `collate` and `to_device` default to the tuned path (`_tuned_path`); the
    torch-naive reference and the bench's peers pass their own.
    """

    def __init__(
        self,
        spec: LoaderSpec,
        transform: Transform | None = None,
        collate: Collate | None = None,
        to_device: Callable[[Any], Iterator[Batch]] | None = None,
        empty: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        if spec.listing is None:
            raise BackendError("the torch backend needs a dataset listing (data.root)")
        super().__init__(
            len(spec.listing), batch_size=spec.batch_size, dist=spec.dist, train=spec.train, seed=spec.seed
        )
        # Its typed options; a plug-in built on this loader without options of its own (naive,
        # torch-uint8, the bench's peers) takes [loader.torch].
        options = spec.options if isinstance(spec.options, TorchLoaderConfig) else spec.loader.torch
        workers = cpu_workers(options.workers, spec.dist.local_world_size)
        self.spec = spec
        self.skip = spec.on_error == "skip"
        self._check_headers()
        if transform is None and spec.train:
            # Strict comparison: the full decode DALI makes (val decodes in full either way).
            transform = partial(train_transform, exact=True) if options.exact_decode else train_transform
        transform = transform or val_transform
        if collate is None:
            collate, to_device, empty = _tuned_path(spec)
        assert to_device is not None and empty is not None
        self.empty = empty  # what a micro-batch of only bad files becomes (skip)
        self.dataloader = self._dataloader(spec.listing, transform, collate, workers)
        # Safe to drop without close(): collected, or at interpreter exit, the workers are
        # shut down (before multiprocessing's own exit handler would wait on them).
        self._finalizer = weakref.finalize(self, shutdown_workers, self.dataloader)
        self.to_device = to_device

    def _check_headers(self) -> None:
        """Headers first, as the dali backend does: a bad file stops the run before its first
        step, or (data.on_error = "skip") is announced now and dropped when its batch comes."""
        bad = self.spec.bad_headers()
        if bad and not self.skip:
            raise bad[0]
        if bad:
            warnings.warn(
                f"data.on_error = skip: {len(bad)} file(s) will be left out when their "
                f"batch comes: {some_of(list(map(str, bad)))}",
                stacklevel=3,  # the loader's maker, as from __init__
            )

    def _dataloader(
        self, listing: Listing, transform: Transform, collate: Collate, workers: int
    ) -> DataLoader:
        """The DataLoader over the listing, its batches drawn by this loader's sampler."""
        spec = self.spec
        return DataLoader(
            ImageDataset(
                listing,
                transform,
                spec.augment,
                spec.max_pixels,
                reads_in_flight(spec.loader.io_depth, listing.prefix),
            ),
            batch_sampler=_LoaderSampler(self),
            num_workers=workers,
            collate_fn=_Checked(collate, self.skip),
            pin_memory=spec.device.type == "cuda",
            worker_init_fn=_worker_init if workers > 0 else None,
            persistent_workers=workers > 0,
            # Forked on Linux, on purpose: workers share the listing page by page and start in
            # milliseconds (spawn would pickle it to each, and re-run an unguarded script). Our
            # reader threads import nothing lazily (register_plugins), so a fork finds no held lock.
            multiprocessing_context="fork" if workers > 0 and sys.platform == "linux" else None,
            prefetch_factor=spec.loader.prefetch if workers > 0 else None,
            # Its own generator: starting an iterator draws the workers' base seed, which from
            # torch's global generator would shift every later draw (Dropout) after a resume.
            generator=torch.Generator().manual_seed(spec.seed * 1009 + spec.dist.rank),
        )

    def __iter__(self) -> Iterator[Batch]:
        self.ensure_open()  # before iter() starts workers that no finaliser would stop
        return self._counted(self.to_device(self._screen(iter(self.dataloader))))

    def _screen(self, batches: Iterator[Any]) -> Iterator[Any]:
        """A worker's decode failures, in the main process: raise one line naming the file, or
        (skip) warn, count, and pass on the rest of the batch."""
        for batch in batches:
            if isinstance(batch, BadSample):
                raise BadImageError(batch.path, batch.reason)
            if isinstance(batch, _Partial):
                for bad in batch.bad:
                    self.skipped_samples += 1
                    warnings.warn(f"skipped {bad.path}: {bad.reason}", stacklevel=2)
                # Every image bad: an empty batch keeps the step counting and the accumulation
                # window (and, under DDP, every rank's collectives) in step; nothing trains.
                batch = batch.batch if batch.batch is not None else self.empty
            yield batch

    def close(self) -> None:
        super().close()
        self._finalizer()


def _tuned_path(
    spec: LoaderSpec,
) -> tuple[Collate, Callable[[Any], Iterator[Batch]], tuple[torch.Tensor, torch.Tensor]]:
    """(collate, to_device, empty batch): uint8 through the workers and normalised on the GPU
    a batch ahead; on a CPU run, normalised in the workers, so the main process only trains."""
    size, aug = spec.crop_size(0), spec.augment  # an empty batch's side does not matter
    labels = torch.zeros(0, dtype=torch.int64)
    if spec.device.type == "cpu":
        return (
            NormalisingCollate(aug.mean, aug.std, spec.channels_last),
            _as_batches,
            (torch.zeros((0, 3, size, size), dtype=spec.dtype), labels),
        )
    return (
        collate_uint8,
        DevicePrefetcher(spec.device, aug.mean, aug.std, spec.dtype, spec.channels_last),
        (torch.zeros((0, size, size, 3), dtype=torch.uint8), labels),
    )


def _as_batches(batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[Batch]:
    return (Batch(images, labels) for images, labels in batches)


class BadSample(NamedTuple):
    """A sample a worker could not decode: travels to the main process instead of a traceback."""

    path: str
    reason: str


class _Partial(NamedTuple):
    """A batch whose bad samples were dropped (data.on_error = "skip"); None if none was good."""

    batch: Any
    bad: list[BadSample]


class _Checked:
    """Collate that keeps a worker's BadSamples out of the batch: the first is passed on alone
    (raise), or the rest is collated and the bad ones ride along (skip)."""

    def __init__(self, collate: Collate, skip: bool) -> None:
        self.collate, self.skip = collate, skip

    def __call__(self, items: list[tuple[Any, int]]) -> Any:
        bad = [image for image, _ in items if isinstance(image, BadSample)]
        if not bad:
            return self.collate(items)
        if not self.skip:
            return bad[0]
        good = [item for item in items if not isinstance(item[0], BadSample)]
        return _Partial(self.collate(good) if good else None, bad)


def build(spec: LoaderSpec) -> Loader:
    """Registry entry point for `--loader torch`."""
    return TorchLoader(spec)


def build_uint8(spec: LoaderSpec) -> Loader:
    """The bench's `torch-uint8`: what the workers of a GPU run deliver (uint8 NHWC batches,
    normalised later on the GPU), measured on a CPU. Not a training backend: its images are
    not normalised."""
    size = spec.crop_size(0)
    return TorchLoader(
        spec,
        collate=collate_uint8,
        to_device=_as_batches,
        empty=(torch.zeros((0, size, size, 3), dtype=torch.uint8), torch.zeros(0, dtype=torch.int64)),
    )
