"""The `dali` backend's loader: feeds and drives the DALI graph (`dali_graph`), yielding `Batch`.

Each rank's samples go through an external source in the epoch's global order, cut by the shared
`ShardPlan`, so class indices, sample order and `len()` match the torch backend's. The bytes are
read from the compact listing as needed, and each training sample's draws are made from its own
seed (`draws.draw_train`, the torch backend's function) on the reader thread that checks its
header: both loaders augment every sample alike, and the loader's state is its position alone.
"""

from __future__ import annotations

import itertools
import time
import warnings
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from stallfree.data.backends.dali_graph import (
    DALIGenericIterator,
    LastBatchPolicy,
    draw_columns,
    image_pipeline,
)
from stallfree.data.backends.dali_probe import environment_problem, first_undecodable
from stallfree.data.backends.dali_words import first_cause, says_out_of_memory
from stallfree.data.backends.prefetch import DevicePrefetcher
from stallfree.data.loader import Batch, Loader, LoaderSpec, ShardedLoader
from stallfree.data.readers.check_pool import cpu_budget
from stallfree.data.readers.headers import read_bytes
from stallfree.data.readers.imageio import BadImageError, check_header, displayed_size
from stallfree.data.readers.inflight import HeldReads, ReaderPool, read_ahead, reads_in_flight, submit
from stallfree.data.readers.startup_check import cached_bad_files
from stallfree.data.registry import BackendError
from stallfree.data.sharding import sample_seeds
from stallfree.data.transforms.draws import Draws, draw_train
from stallfree.errors import StallfreeError, some_of
from stallfree.log import NATIVE_STDERR
from stallfree.parallel import cpu_workers
from stallfree.recipe import DaliLoaderConfig


class DataPipelineError(StallfreeError, RuntimeError):
    """The DALI pipeline stopped on a file it could not read; the message names it."""


class DaliLoader(ShardedLoader):
    """Adapter over DALIGenericIterator that yields `Batch` and hides DALI's iterator quirks."""

    def __init__(self, spec: LoaderSpec) -> None:
        if spec.listing is None:
            raise BackendError("the dali backend needs a dataset listing (data.root)")
        opts: DaliLoaderConfig = spec.options  # [loader.dali], resolved once (registry.resolve)
        # DALI needs at least one thread: 0 means "derive it", like -1.
        self.threads = cpu_workers(opts.threads if opts.threads != 0 else -1, spec.dist.local_world_size)
        # Sample i of the plan is listing entry kept[i] (all of them unless files are skipped).
        self._kept = _usable_ids(spec, self.threads)
        n = len(spec.listing) if self._kept is None else len(self._kept)
        super().__init__(n, batch_size=spec.batch_size, dist=spec.dist, train=spec.train, seed=spec.seed)
        # Files left out by data.on_error = skip count as skipped once per epoch (on rank 0,
        # so that the all-ranks sum is their number).
        self._left_out = len(spec.listing) - n if spec.dist.rank == 0 else 0
        self.spec = spec
        # loader.dali.device = "cpu" keeps the whole graph on the CPU even when training on a GPU.
        gpu = spec.device.type == "cuda" and opts.device != "cpu"
        self.device_id = (spec.device.index or 0) if gpu else None
        self.decode_device = "mixed" if gpu and opts.decode == "auto" else "cpu"
        self.augment_on_gpu = gpu
        # A CPU graph feeding a GPU run hands over uint8; the prefetcher normalises on the GPU.
        self.prefetcher = (
            DevicePrefetcher(spec.device, spec.augment.mean, spec.augment.std, spec.dtype, spec.channels_last)
            if spec.device.type == "cuda" and not gpu
            else None
        )
        self._iterator: DALIGenericIterator | None = None
        self._ended = False  # the live pipeline finished an epoch and awaits its reset
        self._feed_start = 0  # where the source starts in the epoch's order (set before a reset)
        # Files fed per batch of the plan, in order, until the batch is taken: 0 marks a batch
        # whose every file was skipped, which DALI (no empty batches) never sees.
        self._fed: deque[int] = deque()
        self._routing = False  # fd 2 routed (NATIVE_STDERR) until close()
        # DALI calls the source on the training thread: the files are read (and their headers
        # checked) by this pool, loader.io_depth at a time, the next batches ahead.
        self._readers = ReaderPool(reads_in_flight(spec.loader.io_depth, spec.listing.prefix))
        # The next epoch's first reads, submitted as this one ends (its reset would else wait
        # a whole batch's latency, each epoch); used only if that epoch is the next one.
        self._held_reads = HeldReads()
        # Time the training thread spent inside the source, and the batches it handed over.
        self.source_s, self.source_batches = 0.0, 0
        # The first batches' reads start now, while the pipeline is built and the model made.
        first = submit(self._plan(0, 0), self._read, self._readers.get(), max(1, spec.loader.prefetch) + 1)
        self._held_reads.hold(self._run_key(0, 0), first)

    def _build(self) -> DALIGenericIterator:
        """The run's pipeline; its source starts at `_feed_start`."""
        spec = self.spec
        if not self._routing:  # libpng's bare warnings from DALI's threads: through the log
            NATIVE_STDERR.acquire()
            self._routing = True
        pipe = image_pipeline(
            source=self._feed,
            spec=spec,
            decode_device=self.decode_device,
            augment_on_gpu=self.augment_on_gpu,
            raw_uint8=self.prefetcher is not None,
            batch_size=spec.batch_size,
            num_threads=self.threads,
            device_id=self.device_id,
            prefetch_queue_depth=max(1, spec.loader.prefetch),
        )
        policy = LastBatchPolicy.DROP if spec.train else LastBatchPolicy.PARTIAL
        return DALIGenericIterator(
            [pipe], ["images", "labels"], size=-1, last_batch_policy=policy, auto_reset=False
        )

    def _listing_ids(self, ids: np.ndarray) -> np.ndarray:
        return ids if self._kept is None else self._kept[ids]

    def _feed(self) -> Iterator[list[list[np.ndarray]]]:
        """This rank's batches of the current epoch from `_feed_start` on: bytes, labels, the
        epoch's crop side and, in training, each sample's draws (`draw_columns`).

        DALI calls it anew after each reset; its body runs at the first batch DALI asks for,
        i.e. after `__iter__` has set the epoch and the start.
        """
        self._fed.clear()  # a fresh source: what the last one fed is gone with its pipeline
        side = self.spec.crop_size(self.epoch)
        ahead = max(1, self.spec.loader.prefetch)  # as many batches as DALI queues
        next_run = (self._held_reads, self._run_key(self.epoch + 1, 0), self._plan(self.epoch + 1, 0))
        carried = self._held_reads.take(self._run_key(self.epoch, self._feed_start))
        reads_ahead = read_ahead(
            self._plan(self.epoch, self._feed_start),
            self._read,
            self._readers.get(),
            ahead,
            carried,
            next_run,
        )
        started = time.perf_counter()
        for items, reads in reads_ahead:
            kept = [
                (screened, np.array([item[1]], dtype=np.int64))
                for item, read in zip(items, reads)
                if (screened := self._screened(read)) is not None
            ]
            self._fed.append(len(kept))
            if kept:
                self.source_s += time.perf_counter() - started
                self.source_batches += 1
                sides = [np.array(side, dtype=np.float32)] * len(kept)
                columns = [[k[0][0] for k in kept], [k[1] for k in kept], sides]
                if self.spec.train:
                    drawn = [k[0][1] for k in kept]
                    columns += draw_columns([d for d in drawn if d is not None], side, self.spec.augment)
                yield columns
                started = time.perf_counter()
        self.source_s += time.perf_counter() - started

    def _run_key(self, epoch: int, start: int) -> tuple[int | None, int]:
        # Unshuffled (validation), every epoch's order is the same.
        return (epoch if self.shuffle else None, start)

    def _plan(self, epoch: int, start: int) -> Iterator[list[tuple[str, int, int, int]]]:
        """(path, label, augmentation seed, crop side) of each of this rank's batches of
        `epoch` from sample `start` on."""
        listing = self.spec.listing
        assert listing is not None
        order, base = self.epoch_order(epoch)
        side = self.spec.crop_size(epoch)
        for ids in map(self._listing_ids, self.plan.batches(order, start)):
            # Seeded by listing id, as the torch backend's samples are (invariant 2).
            seeds = sample_seeds(base, ids).tolist()
            yield [
                (path, label, seed, side)
                for path, label, seed in zip(listing.paths(ids), listing.labels[ids].tolist(), seeds)
            ]

    def _read(self, item: tuple[str, int, int, int]) -> tuple[bytes, BadImageError | None, Draws | None]:
        """On a reader thread: the file's bytes, what its header check found in them, and (in
        training) the sample's draws, which need the image's size from that header."""
        path, _, seed, side = item
        data = read_bytes(path)
        try:
            if not self.spec.train:
                check_header(path, self.spec.max_pixels, data=data)
                return data, None, None
            width, height = displayed_size(path, self.spec.max_pixels, data=data)
        except BadImageError as exc:
            return data, exc, None
        return data, None, draw_train(width, height, self.spec.augment, side, seed)

    def _screened(
        self, read: Future[tuple[bytes, BadImageError | None, Draws | None]]
    ) -> tuple[np.ndarray, Draws | None] | None:
        """The file's bytes (and draws) once its header passed; a bad one raises, or (skip) is
        counted, named and left out of its batch, as the torch backend's decode does. The
        start-up check's cache cannot see a file rewritten in place, and DALI must never get a
        bomb."""
        data, problem, drawn = read.result()  # a read's own error is raised here, at its sample
        if problem is not None:
            if self.spec.on_error != "skip":
                raise problem
            self.skipped_samples += 1
            warnings.warn(f"skipped {problem.path}: {problem.reason}", stacklevel=2)
            return None
        return np.frombuffer(data, dtype=np.uint8), drawn

    def __iter__(self) -> Iterator[Batch]:
        self.ensure_open()
        if self.batches_left() == 0:  # a state saved at the epoch's end: nothing left of it
            self._start, self._taken, self._finished = 0, 0, True
            return
        if self.position == 0:
            self.skipped_samples += self._left_out
        try:
            # One pipeline serves the run: at an epoch's end its source ends and the next
            # iteration resets it (a rebuild costs start-up); it is rebuilt only where the source
            # must start elsewhere (a resume), and starts over at the next unseen sample.
            if self._iterator is None:
                self._feed_start = self.position
                self._iterator = self._build()
            elif self._ended:  # the next epoch (or the same one again): the source starts over
                self._feed_start, self._ended = self.position, False
                self._iterator.reset()
            elif self.prefetcher is not None:
                # The GPU-side prefetcher took one batch more from DALI than it handed out:
                # rebuild from the next unseen sample rather than skip that batch.
                self._close_iterator()
                self._feed_start = self.position
                self._iterator = self._build()
            # else: re-iterated after stopping mid-epoch; the live pipeline's next batch is the
            # next unseen one, as in the torch backend.
            yield from self._counted(self._batches(self._iterator))
        except (DataPipelineError, BadImageError):  # a bad file met in the source, or named
            self._close_iterator()
            raise
        except RuntimeError as exc:
            self._close_iterator()
            if _is_memory_error(exc):
                raise  # out of memory is not a bad file: the trainer's advice applies
            raise self._explain(exc) from None
        self._ended = True

    def _explain(self, exc: RuntimeError) -> StallfreeError:
        """Name the file that stopped the pipeline although every header was checked
        (`_usable_ids`, `_screened`): decode the batches in flight one by one."""
        environment = environment_problem(str(exc))
        if environment is not None:
            return environment
        in_flight = itertools.islice(
            self.plan.batches(self.epoch_order()[0], self.position), self.spec.loader.prefetch + 2
        )
        assert self.spec.listing is not None
        culprit = first_undecodable(
            self.spec.listing.paths(self._listing_ids(np.concatenate([*in_flight, np.zeros(0, np.int64)])))
        )
        if culprit is not None:
            return BadImageError(culprit[0], f"DALI cannot decode it: {culprit[1]}")
        return DataPipelineError(f"the DALI pipeline stopped: {first_cause(str(exc))}")

    def _batches(self, iterator: DALIGenericIterator) -> Iterator[Batch]:
        # A batch of only skipped files is an empty one, as the torch backend's: the steps and
        # the accumulation window (and DDP's collectives) stay in step.
        side, raw = self.spec.crop_size(self.epoch), self.prefetcher is not None
        hwc = raw or self.spec.channels_last
        empty = [
            {
                "images": torch.zeros(
                    (0, side, side, 3) if hwc else (0, 3, side, side),
                    dtype=torch.uint8 if raw else self.spec.dtype,
                ),
                "labels": torch.zeros(0, dtype=torch.int64),
            }
        ]
        outputs = (empty if data is None else data for data in self._until_epoch_end(iterator))
        if self.prefetcher is None:
            return (self._to_batch(data[0]) for data in outputs)
        return self.prefetcher(
            (data[0]["images"].pin_memory(), data[0]["labels"].reshape(-1).long()) for data in outputs
        )

    def _until_epoch_end(self, iterator: DALIGenericIterator) -> Iterator[Any]:
        """The epoch's remaining outputs, None for a batch of only skipped files. DALI's end
        of epoch is taken with the last one, not when the caller asks past it: a caller that
        takes exactly `len()` batches leaves the pipeline ready for its reset all the same
        (else the next epoch would pay for a rebuild)."""
        left, taken = self.batches_left(), 0
        while taken < left:
            if self._fed and self._fed[0] == 0:  # known before DALI is asked for more
                self._fed.popleft()
                taken += 1
                yield None
                continue
            data = next(iterator, None)
            self._ended = data is None  # DALI's end: only batches of skipped files may be left
            for _ in itertools.takewhile(lambda n: n == 0, list(self._fed)):
                self._fed.popleft()  # fed while DALI was asked, before this output's files
                taken += 1
                yield None
            if data is None:
                if taken < left:
                    raise DataPipelineError("the DALI pipeline gave fewer batches than planned")
                return
            self._fed.popleft()
            taken += 1
            if taken == left:
                if next(iterator, None) is not None:
                    raise DataPipelineError("the DALI pipeline gave more batches than planned")
                self._ended = True
            yield data

    def _to_batch(self, out: dict[str, torch.Tensor]) -> Batch:
        images = out["images"]
        if self.spec.channels_last:
            images = images.permute(0, 3, 1, 2)  # NHWC memory viewed as channels_last NCHW
        if images.dtype != self.spec.dtype:
            images = images.to(self.spec.dtype)
        labels = out["labels"].reshape(-1).long()
        return Batch(
            images.to(self.spec.device, non_blocking=True), labels.to(self.spec.device, non_blocking=True)
        )

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch and self._iterator is not None and not self._ended:
            # Left mid-epoch: the live pipeline holds that epoch's batches, not this one's.
            self._close_iterator()
        super().set_epoch(epoch)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._close_iterator()  # the next iteration builds one whose source starts there

    def _close_iterator(self) -> None:
        self._iterator, self._ended = None, False  # drops the pipeline, its threads and buffers
        self._fed.clear()

    def close(self) -> None:
        super().close()
        self._close_iterator()
        self._held_reads.cancel()
        self._readers.close()
        if self._routing:
            NATIVE_STDERR.release()
            self._routing = False


def _usable_ids(spec: LoaderSpec, threads: int) -> np.ndarray | None:
    """The listing entries DALI may read: None for all of them.

    DALI cannot skip a sample, and a decompression bomb would decode to many GB first: every
    header is checked (each rank its share; cached per dataset state), and a bad one raises.
    Under data.on_error = "skip" the split is fully decoded once instead (cached likewise) and
    the bad files are left out, so the epoch has fewer samples than the torch backend's.
    """
    assert spec.listing is not None
    if spec.on_error != "skip":
        bad = spec.bad_headers()
        if bad:
            raise bad[0]
        return None
    bad_files = cached_bad_files(
        spec.listing,
        sources=spec.sources,
        max_pixels=spec.max_pixels,
        workers=cpu_budget(spec.dist.local_world_size),  # before DALI's threads start: every core
        dist=spec.dist,
    )
    if not bad_files:
        return None
    named = [f"{path}: {reason}" for path, reason in bad_files.items()]
    warnings.warn(
        f"data.on_error = skip: {len(bad_files)} file(s) of the {spec.split} split "
        f"left out: {some_of(named)}",
        stacklevel=3,
    )
    return np.array(
        [i for i, path in enumerate(spec.listing.iter_paths()) if path not in bad_files], dtype=np.int64
    )


def _is_memory_error(exc: BaseException) -> bool:
    # By type where torch has one; DALI's allocators raise RuntimeError (dali_words reads it).
    return isinstance(exc, torch.OutOfMemoryError) or says_out_of_memory(str(exc))


def build(spec: LoaderSpec) -> Loader:
    """Registry entry point for `--loader dali`."""
    return DaliLoader(spec)
