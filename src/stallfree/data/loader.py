"""The Loader contract and its sharded base class (`stallfree.data.build` builds loaders).

The trainer sees only `Batch` and `Loader`; every backend quirk stays inside its adapter.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from stallfree.data.readers.imageio import BadImageError
from stallfree.data.readers.listing import Listing
from stallfree.data.readers.startup_check import bad_headers_at_start
from stallfree.data.sharding import ShardPlan, epoch_permutation
from stallfree.errors import StallfreeError
from stallfree.parallel import DistInfo
from stallfree.recipe import DEFAULT_MAX_PIXELS, AugmentConfig, LoaderConfig


class LoaderClosedError(StallfreeError):
    """A closed loader was iterated: its workers and pipeline are gone."""


class Batch(NamedTuple):
    """Normalised float images (NCHW, on device) and int64 labels (on device)."""

    images: torch.Tensor
    labels: torch.Tensor


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
    dist: DistInfo = field(default_factory=DistInfo)
    max_pixels: int = DEFAULT_MAX_PIXELS
    on_error: str = "raise"  # data.on_error: "raise" or "skip"
    synthetic_samples: int = 0  # dataset size the synthetic backend pretends when there is no data
    sources: tuple[str, ...] = ()  # folders or shards the listing came from (cache keys)
    checked_by: tuple[str, int] | None = None  # (version, max_pixels) of a data check list
    # The backend's own table, typed: [loader.torch], [loader.dali], or a plug-in's declared
    # options checked from [loader.plugin], or the backend a wrapper wraps (registry.resolve).
    options: Any = None

    @property
    def train(self) -> bool:
        return self.split == "train"

    def bad_headers(self) -> list[BadImageError]:
        """The split's files with a bad header, checked once per dataset state (cached), in
        worker interpreters on this rank's share of the cores."""
        assert self.listing is not None
        return bad_headers_at_start(
            self.listing,
            sources=self.sources,
            checked_by=self.checked_by,
            max_pixels=self.max_pixels,
            dist=self.dist,
        )

    def crop_size(self, epoch: int) -> int:
        """The side of this split's images in `epoch`: the train schedule's, or the val size."""
        return self.augment.size_at(epoch) if self.train else self.augment.val_size

    @property
    def num_samples(self) -> int:
        return len(self.listing) if self.listing is not None else self.synthetic_samples


class Loader(ABC):
    """An epoch-aware, resumable, sharded iterable of `Batch`.

    State is (epoch, position): `position` counts samples of the epoch's *global* order that all
    ranks together have consumed, so it means the same under any micro-batch split or world size.
    """

    @property
    @abstractmethod
    def epoch(self) -> int:
        """The epoch whose order the next iteration follows."""

    @property
    @abstractmethod
    def position(self) -> int:
        """Samples of this epoch's global order already consumed (by all ranks together)."""

    @abstractmethod
    def __iter__(self) -> Iterator[Batch]:
        """Yield this rank's remaining batches of the current epoch."""

    @abstractmethod
    def __len__(self) -> int:
        """Batches this rank gets in one whole epoch."""

    @abstractmethod
    def batches_left(self) -> int:
        """Batches this rank will yield from `position` to the end of the epoch."""

    @abstractmethod
    def set_epoch(self, epoch: int) -> None:
        """Select the (seed, epoch) shuffle; a different epoch starts at position 0."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Resumable state: at least `epoch` and `position`."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state saved by `state_dict`, possibly under another split or world size."""

    _step_mark: tuple[int, int] | None = None  # (epoch, position) after the last optimizer step

    def mark_step(self) -> None:
        """Note where this loader stands after an optimizer step (the trainer's caller does)."""
        self._step_mark = (self.epoch, self.position)

    def state_at_last_step(self) -> dict[str, Any]:
        """`state_dict()` as of the last `mark_step`: the batches fetched since (an accumulation
        window cut short) are given back, every rank's, since positions are global samples; an
        epoch begun since with no step yet starts at 0. Unmarked: the state as it is."""
        state = self.state_dict()
        if self._step_mark is not None:
            epoch, position = self._step_mark
            state["position"] = position if int(state["epoch"]) == epoch else 0
        return state

    closed = False  # set by close(): iterating again raises LoaderClosedError

    def close(self) -> None:
        """Release workers and pipelines; the loader cannot be iterated afterwards."""
        self.closed = True

    def ensure_open(self) -> None:
        """Raise LoaderClosedError once `close()` has run (a new worker would outlive it)."""
        if self.closed:
            raise LoaderClosedError(
                f"this {type(self).__name__} was closed (close(), or the end of its with block); "
                "build another, e.g. with stallfree.loader(...), to iterate again"
            )

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        """Leaving a `with` block closes the loader, as `close()` does."""
        self.close()


class ShardedLoader(Loader):
    """A Loader over `n` samples cut by a `ShardPlan`; backends only turn sample ids into Batches."""

    def __init__(self, n: int, *, batch_size: int, dist: DistInfo, train: bool, seed: int) -> None:
        self.plan = ShardPlan(n, batch_size, dist.rank, dist.world_size, drop_last=train)
        self.shuffle, self.seed = train, seed
        self._epoch, self._start, self._taken = 0, 0, 0
        self._finished = False  # the last iteration ran to the epoch's end
        self.skipped_samples = 0  # bad files dropped under data.on_error = "skip", this rank

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        return self.plan.position_after(self._start, self._taken)

    def __len__(self) -> int:
        return self.plan.num_batches(0)

    def batches_left(self) -> int:
        return self.plan.num_batches(self.position)

    def set_epoch(self, epoch: int) -> None:
        # Keep a restored mid-epoch position when the trainer re-announces that same epoch.
        if epoch != self._epoch:
            self._epoch, self._start, self._taken, self._finished = epoch, 0, 0, False

    def state_dict(self) -> dict[str, Any]:
        # Once an epoch has run to its end the loader starts it over if iterated again, but
        # a state saved there resumes with the next epoch's start: its end was reached.
        return {
            "epoch": self._epoch + 1 if self._finished else self._epoch,
            "position": 0 if self._finished else self.position,
            "batch_size": self.plan.batch_size,
            "world_size": self.plan.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._epoch, self._start, self._taken = int(state["epoch"]), int(state["position"]), 0
        self._finished = False

    def same_shards(self, state: dict[str, Any]) -> bool:
        """True when `state` was saved under this loader's micro-batch size and world size."""
        return (state.get("batch_size"), state.get("world_size")) == (
            self.plan.batch_size,
            self.plan.world_size,
        )

    def epoch_order(self, epoch: int | None = None) -> tuple[np.ndarray, int]:
        """(order, augmentation seed base) of `epoch`, by default the current one (see
        `sample_seeds`)."""
        epoch = self._epoch if epoch is None else epoch
        return epoch_permutation(self.plan.n, seed=self.seed, epoch=epoch, shuffle=self.shuffle)

    def remaining_ids(self) -> Iterator[np.ndarray]:
        """This rank's micro-batches of sample ids from the current position on."""
        return self.plan.batches(self.epoch_order()[0], self.position)

    def _counted(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """Yield `batches`, advancing the position; a finished epoch goes back to its start."""
        self.ensure_open()
        self._start, self._taken, self._finished = self.position, 0, False
        batches = iter(batches)
        while True:
            self.ensure_open()  # before asking a closed loader's stopped workers for a batch
            batch = next(batches, None)
            if batch is None:
                break
            self._taken += 1
            yield batch
        self._start, self._taken, self._finished = 0, 0, True
