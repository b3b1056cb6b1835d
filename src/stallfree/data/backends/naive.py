"""`torch-naive`: the textbook DataLoader, a benchmark reference and not a product backend.

Full-resolution PIL decode, float `ToTensor` and `Normalize` in the workers, the default
collate (float32 batches: 4x the bytes of uint8 through shared memory and PCIe), no draft(),
no device-side normalisation. It is the `torch` backend's loader with those three parts
swapped, so `stallfree bench` shows exactly what the tuning buys.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator

import numpy as np
import torch
from PIL import Image
from torch.utils.data._utils.collate import default_collate

from stallfree.data.backends.torch_backend import TorchLoader
from stallfree.data.loader import Batch, Loader, LoaderSpec
from stallfree.data.readers.imageio import open_rgb
from stallfree.data.transforms.augment import random_resized_crop_box, val_transform
from stallfree.recipe import DEFAULT_MAX_PIXELS, AugmentConfig


def _to_normalised_tensor(pixels: np.ndarray, aug: AugmentConfig) -> torch.Tensor:
    # torchvision's ToTensor + Normalize, done per sample in the worker.
    x = torch.from_numpy(np.array(pixels)).permute(2, 0, 1).float().div(255)
    mean = torch.tensor(aug.mean).view(3, 1, 1)
    std = torch.tensor(aug.std).view(3, 1, 1)
    return (x - mean) / std


def naive_train(
    path: str, aug: AugmentConfig, side: int, seed: int, max_pixels: int = DEFAULT_MAX_PIXELS
) -> torch.Tensor:
    """Decode the whole image, then RandomResizedCrop, flip, ToTensor, Normalize."""
    rng = random.Random(seed)
    img = open_rgb(path, max_pixels)
    left, top, w, h = random_resized_crop_box(img.width, img.height, aug.scale, aug.ratio, rng)
    img = img.crop((left, top, left + w, top + h)).resize((side, side), Image.Resampling.BILINEAR)
    if rng.random() < aug.hflip:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return _to_normalised_tensor(np.asarray(img), aug)


def naive_val(
    path: str, aug: AugmentConfig, side: int, seed: int = 0, max_pixels: int = DEFAULT_MAX_PIXELS
) -> torch.Tensor:
    """The torch backend's val transform, then ToTensor, Normalize."""
    return _to_normalised_tensor(val_transform(path, aug, side, seed, max_pixels), aug)


def build(spec: LoaderSpec) -> Loader:
    """Entry point, used as the plug-in `stallfree.data.backends.naive:build`."""

    def to_device(batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[Batch]:
        for images, labels in batches:  # float batches copied as they are
            yield Batch(images.to(spec.device, spec.dtype), labels.to(spec.device))

    size = spec.crop_size(0)
    empty = (torch.zeros((0, 3, size, size)), torch.zeros(0, dtype=torch.int64))
    return TorchLoader(spec, naive_train if spec.train else naive_val, default_collate, to_device, empty)
