"""`torch-naive`: the textbook DataLoader, a benchmark reference and not a product backend.

Full-resolution PIL decode, float `ToTensor` and `Normalize` in the workers, the default
collate (float32 batches: 4x the bytes of uint8 through shared memory and PCIe), no draft(),
no device-side normalisation. `stallfree bench` runs it to show what the tuning buys.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torch.utils.data._utils.collate import default_collate

from stallfree.data.augment import open_rgb, random_resized_crop_box, val_transform
from stallfree.data.loader import Batch, CursorLoader, Loader, LoaderSpec
from stallfree.data.torch_backend import (ImageDataset, ShardedBatchSampler, cpu_workers,
                                          shutdown_workers)
from stallfree.recipe import AugmentConfig


def _to_normalised_tensor(pixels: np.ndarray, aug: AugmentConfig) -> torch.Tensor:
    # torchvision's ToTensor + Normalize, done per sample in the worker.
    x = torch.from_numpy(np.array(pixels)).permute(2, 0, 1).float().div(255)
    mean = torch.tensor(aug.mean).view(3, 1, 1)
    std = torch.tensor(aug.std).view(3, 1, 1)
    return (x - mean) / std


def naive_train(path: str, aug: AugmentConfig, seed: int) -> torch.Tensor:
    """Decode the whole image, then RandomResizedCrop, flip, ToTensor, Normalize."""
    rng = random.Random(seed)
    img = open_rgb(path)
    left, top, w, h = random_resized_crop_box(img.width, img.height, aug.scale, aug.ratio, rng)
    img = img.crop((left, top, left + w, top + h)).resize((aug.image_size,) * 2, Image.BILINEAR)
    if rng.random() < aug.hflip:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    return _to_normalised_tensor(np.asarray(img), aug)


def naive_val(path: str, aug: AugmentConfig, seed: int = 0) -> torch.Tensor:
    return _to_normalised_tensor(val_transform(path, aug), aug)


class NaiveLoader(CursorLoader):
    """Float batches from the workers, copied to the device as they are."""

    def __init__(self, spec: LoaderSpec) -> None:
        if spec.listing is None:
            raise ValueError("torch-naive needs a dataset listing (data.root)")
        super().__init__()
        self.spec = spec
        self.sampler = ShardedBatchSampler(
            len(spec.listing), batch_size=spec.batch_size, train=spec.train, seed=spec.seed,
            rank=spec.dist.rank, world_size=spec.dist.world_size, cursor=self.cursor)
        workers = cpu_workers(spec.loader.workers, spec.dist.local_world_size)
        transform = naive_train if spec.train else naive_val
        self.dataloader = DataLoader(
            ImageDataset(spec.listing, transform, spec.augment), batch_sampler=self.sampler,
            num_workers=workers, collate_fn=default_collate, pin_memory=spec.device.type == "cuda",
            persistent_workers=workers > 0)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Batch]:
        device, dtype = self.spec.device, self.spec.dtype
        return self._counted(Batch(images.to(device, dtype), labels.to(device))
                             for images, labels in self.dataloader)

    def close(self) -> None:
        shutdown_workers(self.dataloader)


def build(spec: LoaderSpec) -> Loader:
    """Entry point, used as the plug-in `stallfree.data.naive:build`."""
    return NaiveLoader(spec)
