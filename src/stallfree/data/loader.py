"""The Loader contract, the backend registry and `build_loader`.

The trainer sees only `Batch` and `Loader`; every backend quirk stays inside its adapter.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from stallfree.data.listing import Listing, list_split
from stallfree.data.sharding import EpochCursor
from stallfree.recipe import AugmentConfig, LoaderConfig, Recipe


class Batch(NamedTuple):
    """Normalised float images (NCHW, on device) and int64 labels (on device)."""

    images: torch.Tensor
    labels: torch.Tensor


@dataclass(frozen=True, slots=True)
class DistInfo:
    """Where this process sits in a (possibly single-process) job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1


@dataclass(kw_only=True, slots=True)
class LoaderSpec:
    """Everything a backend needs, resolved: configs plus runtime objects (device, rank)."""

    split: str
    listing: Listing | None
    num_classes: int
    augment: AugmentConfig
    loader: LoaderConfig
    batch_size: int
    seed: int
    device: torch.device
    dtype: torch.dtype
    channels_last: bool
    dist: DistInfo
    synthetic_samples: int = 0  # dataset size the synthetic backend pretends when there is no data

    @property
    def train(self) -> bool:
        return self.split == "train"


class Loader(ABC):
    """An epoch-aware, resumable, sharded iterable of `Batch`."""

    @abstractmethod
    def __iter__(self) -> Iterator[Batch]:
        """Yield this rank's remaining batches of the current epoch."""

    @abstractmethod
    def __len__(self) -> int:
        """Batches this rank gets in one whole epoch."""

    @abstractmethod
    def set_epoch(self, epoch: int) -> None:
        """Select the (seed, epoch) shuffle for the next iteration."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Position to resume from: the next unseen batch."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by `state_dict`."""

    def close(self) -> None:  # noqa: B027 - optional: loaders without workers have nothing to free
        """Release workers and pipelines."""


class CursorLoader(Loader):
    """A Loader whose resumable state is an `EpochCursor` (epoch, batches already yielded)."""

    def __init__(self) -> None:
        self.cursor = EpochCursor()

    def set_epoch(self, epoch: int) -> None:
        self.cursor.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.cursor.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor.load_state_dict(state)

    def _counted(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """Yield `batches`, advancing the cursor; a finished epoch resets it to the start."""
        for batch in batches:
            self.cursor.position += 1
            yield batch
        self.cursor.position = 0


class BackendError(ValueError):
    """An unknown backend or one whose optional dependency is missing."""


# Built-in backends, imported lazily so that DALI is needed only when chosen.
BACKENDS: dict[str, str] = {
    "torch": "stallfree.data.torch_backend:build",
    "synthetic": "stallfree.data.synthetic:build",
    "dali": "stallfree.data.dali_backend:build",
}


def resolve_backend(name: str) -> Callable[[LoaderSpec], Loader]:
    """Look up a registered backend, or a `module:function` plug-in."""
    target = BACKENDS.get(name, name if ":" in name else None)
    if target is None:
        raise BackendError(
            f"unknown loader backend {name!r}; available: {', '.join(BACKENDS)} "
            "or a plug-in given as 'module:function'"
        )
    module_name, _, func = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise BackendError(f"loader backend {name!r} could not be imported: {exc}") from exc
    return getattr(module, func)


def loader_dtype(precision: str, device: torch.device) -> torch.dtype:
    """Images arrive in the autocast dtype on CUDA (half the bytes); float32 on CPU."""
    if device.type == "cuda" and precision in ("bf16", "fp16"):
        return torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.float32


def build_loader(recipe: Recipe, split: str, *, backend: str | None = None,
                 device: torch.device, dist: DistInfo = DistInfo(),
                 listing: Listing | None = None) -> Loader:
    """Build the loader of `split` ("train" or "val") for this rank."""
    backend = backend or recipe.loader.backend
    if listing is None and recipe.data.root:
        listing = list_split(recipe.data.root, split, recipe.data.file_list or None)
    if listing is None and backend != "synthetic":
        raise BackendError(f"loader backend {backend!r} needs data.root; set --set data.root=PATH")
    num_classes = recipe.model.num_classes or (
        len(listing.classes) if listing else recipe.data.synthetic_classes
    )
    spec = LoaderSpec(
        split=split, listing=listing, num_classes=num_classes, augment=recipe.augment,
        loader=recipe.loader, batch_size=recipe.train.batch_size, seed=recipe.train.seed,
        device=device, dtype=loader_dtype(recipe.train.precision, device),
        channels_last=recipe.train.channels_last, dist=dist,
        synthetic_samples=recipe.data.synthetic_samples,
    )
    return resolve_backend(backend)(spec)
