"""The loaders people would pick instead of stallfree, for `stallfree bench` to run beside ours.

Each peer does the torch backend's train work (RandomResizedCrop with the recipe's scale and
ratio, horizontal flip, normalise, batches of train.batch_size) with the same number of worker
processes, the way its own documentation writes it: no stallfree code in the per-sample path.
They are loader backends by `module:function` (`stallfree.bench.variants.PEERS`), so the bench
measures them as it measures ours. A peer has no resume: nothing but the bench trains on one.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader

from stallfree.data.backends.torch_backend import shutdown_workers
from stallfree.data.loader import Batch, Loader, LoaderSpec
from stallfree.data.readers.listing import Listing
from stallfree.data.readers.startup_check import cache_dir
from stallfree.data.registry import BackendError
from stallfree.data.transforms.augment import random_resized_crop_box
from stallfree.parallel import cpu_workers
from stallfree.recipe import AugmentConfig


class PeerLoader(Loader):
    """Epochs of a peer's DataLoader, as Batches on the device; no resume."""

    def __init__(self, spec: LoaderSpec, make: Callable[[int], Iterable[Any]], batches: int) -> None:
        self.spec, self._make, self._batches, self._epoch = spec, make, batches, 0
        self._iterable: Iterable[Any] | None = None

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        return 0

    def __len__(self) -> int:
        return self._batches

    def batches_left(self) -> int:
        return self._batches

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def __iter__(self) -> Iterator[Batch]:
        if self._iterable is None:
            self._iterable = self._make(self.spec.seed)
        device = self.spec.device
        for images, labels in self._iterable:
            yield Batch(
                images.to(device, self.spec.dtype, non_blocking=True), labels.to(device, non_blocking=True)
            )

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "position": 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise BackendError("a bench peer cannot resume; train with dali or torch")

    def close(self) -> None:
        if isinstance(self._iterable, DataLoader):
            shutdown_workers(self._iterable)
        self._iterable = None


def _workers(spec: LoaderSpec) -> int:
    # The torch backend's rule, so that every loader gets the same CPU budget.
    return cpu_workers(spec.loader.torch.workers, spec.dist.local_world_size)


def _loader_kwargs(spec: LoaderSpec) -> dict[str, Any]:
    workers = _workers(spec)
    return {
        "num_workers": workers,
        "pin_memory": spec.device.type == "cuda",
        "persistent_workers": workers > 0,
        "prefetch_factor": spec.loader.prefetch if workers > 0 else None,
    }


def _normalise(pixels: np.ndarray, aug: AugmentConfig) -> torch.Tensor:
    """torchvision's ToTensor + Normalize on one HWC uint8 image."""
    x = torch.from_numpy(pixels).permute(2, 0, 1).float().div_(255)
    mean = torch.tensor(aug.mean).view(3, 1, 1)
    std = torch.tensor(aug.std).view(3, 1, 1)
    return x.sub_(mean).div_(std)


def pil_crop(img: Image.Image, aug: AugmentConfig) -> torch.Tensor:
    """RandomResizedCrop + flip + ToTensor + Normalize on a PIL image, Python's `random`
    seeded per worker by the DataLoader (torchvision's recipe)."""
    # The module's functions are the methods of its hidden Random, the one the DataLoader seeds.
    rng = cast(random.Random, random)
    left, top, w, h = random_resized_crop_box(img.width, img.height, aug.scale, aug.ratio, rng)
    size = aug.size_at(0)  # peers train at one size
    img = img.resize((size, size), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
    if random.random() < aug.hflip:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return _normalise(np.array(img), aug)  # a copy, as ToTensor makes: asarray is read-only


class _PilFiles(torch.utils.data.Dataset):
    def __init__(self, listing: Listing, aug: AugmentConfig) -> None:
        self.listing, self.aug = listing, aug

    def __len__(self) -> int:
        return len(self.listing)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        with Image.open(self.listing.path(index)) as img:
            size = self.aug.size_at(0)
            img.draft("RGB", (size, size))  # the one trick a careful user knows
            return pil_crop(img.convert("RGB"), self.aug), int(self.listing.labels[index])


def _listing(spec: LoaderSpec) -> Listing:
    if spec.listing is None:
        raise BackendError("a bench peer needs a dataset listing (data.root)")
    return spec.listing


def pil_plain(spec: LoaderSpec) -> Loader:
    """`peer-pil`: a plain DataLoader over the files, PIL with `draft()`, ToTensor + Normalize in
    the workers (what a careful PyTorch user writes; torchvision's transforms on PIL images do
    the same work, and torchvision is not needed)."""
    listing = _listing(spec)

    def make(seed: int) -> DataLoader:
        return DataLoader(
            _PilFiles(listing, spec.augment),
            batch_size=spec.batch_size,
            shuffle=True,
            drop_last=True,
            generator=torch.Generator().manual_seed(seed),
            **_loader_kwargs(spec),
        )

    return PeerLoader(spec, make, len(listing) // spec.batch_size)


def webdataset_peer(spec: LoaderSpec) -> Loader:
    """`peer-webdataset`: webdataset 0.2/1.x's own pipeline over tar shards of the same files
    (packed once into the cache), PIL decode, `WebLoader`."""
    try:
        import webdataset as wds
    except ImportError as exc:
        raise BackendError("peer-webdataset needs webdataset: pip install webdataset") from exc
    listing = _listing(spec)
    shards = _shards_of(listing)
    aug = spec.augment
    batches = len(listing) // spec.batch_size

    def sample(item: tuple[Image.Image, Any]) -> tuple[torch.Tensor, int]:
        img, label = item
        return pil_crop(img, aug), int(label)

    def make(seed: int) -> Iterable[Any]:
        random.seed(seed)
        dataset = (
            wds.WebDataset(
                shards, shardshuffle=len(shards), empty_check=False, nodesplitter=wds.split_by_node
            )
            .shuffle(1000)
            .decode("pil")
            .to_tuple("jpg;jpeg;png;bmp;webp", "cls")
            .map(sample)
            .batched(spec.batch_size, partial=False)
        )
        # Each worker reads whole shards (split by worker); the epoch ends when they do, or at
        # the split's number of batches.
        return wds.WebLoader(dataset, batch_size=None, **_loader_kwargs(spec)).with_epoch(batches)

    return PeerLoader(spec, make, batches)


def _shards_of(listing: Listing) -> list[str]:
    """The split packed as WebDataset shards (8 MB, shuffled) in the cache; packed once."""
    from stallfree.data.tools.pack import pack_split

    folder = cache_dir() / "peers" / f"wds-{listing.digest()[:16]}"
    done = folder / "DONE"
    if not done.exists():
        folder.mkdir(parents=True, exist_ok=True)
        order = np.random.default_rng(0).permutation(len(listing))
        samples = [(listing.path(int(i)), int(listing.labels[i])) for i in order]
        pack_split(samples, folder, "train", 8_000_000, progress=False)
        done.write_text("")
    return sorted(str(p) for p in Path(folder).glob("train-*.tar"))


def torchvision_peer(spec: LoaderSpec) -> Loader:
    """`peer-torchvision`: torchvision.io decode and transforms v2 on uint8 tensors, where
    torchvision is installed (the NVIDIA container)."""
    try:
        import torchvision
        from torchvision.transforms import v2
    except ImportError as exc:  # also what a CPU torch with a CUDA torchvision raises
        raise BackendError(f"peer-torchvision needs a torchvision that imports: {exc}") from exc
    listing = _listing(spec)
    aug = spec.augment
    transform = v2.Compose(
        [
            v2.RandomResizedCrop(
                aug.size_at(0), scale=tuple(aug.scale), ratio=tuple(aug.ratio), antialias=True
            ),
            v2.RandomHorizontalFlip(aug.hflip),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(aug.mean, aug.std),
        ]
    )

    class Files(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(listing)

        def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
            image = torchvision.io.decode_image(listing.path(index), mode=torchvision.io.ImageReadMode.RGB)
            return transform(image), int(listing.labels[index])

    def make(seed: int) -> DataLoader:
        return DataLoader(
            Files(),
            batch_size=spec.batch_size,
            shuffle=True,
            drop_last=True,
            generator=torch.Generator().manual_seed(seed),
            **_loader_kwargs(spec),
        )

    return PeerLoader(spec, make, len(listing) // spec.batch_size)
