"""The `torch` backend: a tuned PyTorch DataLoader.

PIL decode and uint8 augmentation in worker processes, a uint8 collate, pinned memory, and
normalisation on the device in a prefetcher that overlaps the next copy with compute.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from stallfree.data.augment import train_transform, val_transform
from stallfree.data.listing import Listing
from stallfree.data.loader import Batch, CursorLoader, Loader, LoaderSpec
from stallfree.data.prefetch import DevicePrefetcher
from stallfree.data.sharding import EpochCursor, epoch_permutation, num_batches, shard
from stallfree.recipe import AugmentConfig

# (path, augmentation spec, per-sample seed) -> one decoded, augmented sample
Transform = Callable[[str, AugmentConfig, int], Any]


class ImageDataset(Dataset):
    """Index by (sample id, augmentation seed) so augmentation is independent of worker layout."""

    def __init__(self, listing: Listing, transform: Transform, aug: AugmentConfig) -> None:
        self.samples, self.transform, self.aug = listing.samples, transform, aug

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: tuple[int, int]) -> tuple[Any, int]:
        index, seed = key
        path, label = self.samples[index]
        try:
            return self.transform(path, self.aug, seed), label
        except Exception as exc:  # noqa: BLE001 - any decode failure gets the file name attached
            raise RuntimeError(
                f"cannot decode {path}: {exc}. Check the dataset for corrupt files, "
                "or exclude them with data.file_list"
            ) from exc


class ShardedBatchSampler(Sampler[list[tuple[int, int]]]):
    """This rank's batches of (sample id, seed) for the cursor's epoch, from its position on."""

    def __init__(self, n: int, *, batch_size: int, train: bool, seed: int, rank: int,
                 world_size: int, cursor: EpochCursor) -> None:
        self.n, self.batch_size, self.train, self.seed = n, batch_size, train, seed
        self.rank, self.world_size, self.cursor = rank, world_size, cursor

    def __len__(self) -> int:
        return num_batches(self.n // self.world_size, self.batch_size, drop_last=self.train)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        order, seeds = epoch_permutation(self.n, seed=self.seed, epoch=self.cursor.epoch,
                                         shuffle=self.train)
        mine = shard(order, self.rank, self.world_size)
        for b in range(self.cursor.position, len(self)):
            ids = mine[b * self.batch_size:(b + 1) * self.batch_size]
            yield [(int(i), int(seeds[i])) for i in ids]


def collate_uint8(items: list[tuple[np.ndarray, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack HWC uint8 arrays into one NHWC uint8 tensor: a quarter of float32's bytes."""
    images = torch.from_numpy(np.stack([array for array, _ in items]))  # one copy, writable
    labels = torch.tensor([label for _, label in items], dtype=torch.int64)
    return images, labels


def _worker_init(_: int) -> None:
    # Each worker decodes one image at a time; intra-op threads would only oversubscribe cores.
    torch.set_num_threads(1)


def cpu_workers(requested: int, local_world_size: int) -> int:
    """`requested` when >= 0; else the cores this process may use, shared among the node's ranks."""
    if requested >= 0:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(16, cores // max(1, local_world_size)))


def shutdown_workers(dataloader: DataLoader) -> None:
    """Stop persistent workers now. Dropping the iterator is not enough when a generator that
    was left mid-epoch still holds it: its workers would die only at interpreter exit."""
    iterator = dataloader._iterator  # noqa: SLF001 - DataLoader has no public shutdown
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()  # noqa: SLF001
    dataloader._iterator = None  # noqa: SLF001


class TorchLoader(CursorLoader):
    """DataLoader adapter that yields `Batch` on the device and resumes mid-epoch."""

    def __init__(self, spec: LoaderSpec, transform: Transform | None = None) -> None:
        if spec.listing is None:
            raise ValueError("the torch backend needs a dataset listing (data.root)")
        super().__init__()
        self.sampler = ShardedBatchSampler(
            len(spec.listing), batch_size=spec.batch_size, train=spec.train, seed=spec.seed,
            rank=spec.dist.rank, world_size=spec.dist.world_size, cursor=self.cursor,
        )
        workers = cpu_workers(spec.loader.workers, spec.dist.local_world_size)
        transform = transform or (train_transform if spec.train else val_transform)
        self.dataloader = DataLoader(
            ImageDataset(spec.listing, transform, spec.augment),
            batch_sampler=self.sampler,
            num_workers=workers,
            collate_fn=collate_uint8,
            pin_memory=spec.device.type == "cuda",
            worker_init_fn=_worker_init if workers > 0 else None,
            persistent_workers=workers > 0,
            prefetch_factor=spec.loader.prefetch if workers > 0 else None,
        )
        self.prefetcher = DevicePrefetcher(spec.device, spec.augment.mean, spec.augment.std,
                                           spec.dtype, spec.channels_last)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Batch]:
        return self._counted(self.prefetcher(self.dataloader))

    def close(self) -> None:
        shutdown_workers(self.dataloader)


def build(spec: LoaderSpec) -> Loader:
    """Registry entry point for `--loader torch`."""
    return TorchLoader(spec)
