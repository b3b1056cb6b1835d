"""The run's settings: recipe -> `RunContext` (the device, ranks, loader backend, dataset and
the `Resolved` record of what each "auto" became). Shared by `train`, `eval`, `bench` and
`stallfree.loader()`, so each fact has one place where it is worked out. It imports no
Trainer, model or optimizer code (train/assemble.py builds those from a RunContext).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Sequence
from typing import Any, cast

import torch

from stallfree.data import autotune, registry, storage
from stallfree.data.build import build_loader, loader_dtype, measure_auto_count
from stallfree.data.choose import resolve_auto
from stallfree.data.loader import Loader, LoaderSpec
from stallfree.data.readers.factory import resolve_dataset
from stallfree.data.readers.folders import Dataset, class_count
from stallfree.data.readers.inflight import reads_in_flight
from stallfree.data.readers.paths import data_root
from stallfree.data.registry import BackendError, ResolvedBackend
from stallfree.log import LOGGER
from stallfree.parallel import DistInfo
from stallfree.recipe import Recipe, RecipeError
from stallfree.resolved import Resolved
from stallfree.train.checkpoint import SavedCheckpoint
from stallfree.train.distributed import resolve_device
from stallfree.train.precision import resolve_precision
from stallfree.version import __version__


@dataclasses.dataclass(frozen=True, slots=True)
class RunContext:
    """One run's settings: the recipe as given (never changed), the device, the ranks, the
    loader backend (resolved once: name, builder, typed options, tuned count), the `Resolved`
    record of what each "auto" became and (once listed) the dataset. Everything derived from
    them is a property here."""

    recipe: Recipe
    device: torch.device
    dist: DistInfo
    backend: ResolvedBackend
    resolved: Resolved
    dataset: Dataset | None = None
    autotune: dict[str, Any] | None = None  # what workers/threads = "auto" measured, if it did
    resume: SavedCheckpoint | None = None  # the checkpoint the run continues from, if any

    @property
    def resuming(self) -> bool:
        """Whether the run continues from a checkpoint (whose weights are loaded later)."""
        return self.resume is not None

    def with_resume(self, found: SavedCheckpoint | None) -> RunContext:
        """This context continuing from `found` (None: a fresh start)."""
        return dataclasses.replace(self, resume=found)

    def with_resolved(self, **decided: Any) -> RunContext:
        """This context with more of its record decided (e.g. a DDP run's micro_batch)."""
        return dataclasses.replace(self, resolved=dataclasses.replace(self.resolved, **decided))

    def with_dataset(self) -> RunContext:
        """This context with the dataset listed (once; the slow part of a start). Resuming: an
        s3:// root's cached listing, the one the run started with, is used."""
        if self.dataset is not None or not self.recipe.data.root:
            return self
        data, seed = self.recipe.data, self.recipe.train.seed
        dataset = resolve_dataset(data, seed=seed, reuse_listing=self.resuming)
        depth = reads_in_flight(self.recipe.loader.io_depth, dataset.splits["train"].prefix)
        return dataclasses.replace(self, dataset=dataset).with_resolved(io_depth=depth)

    def with_loader_counts(self, previous: Resolved | None = None) -> RunContext:
        """This context with a `workers`/`threads = "auto"` decided: the count the run chose at
        its start when `previous` (a checkpoint's record; by default the resumed one's) holds
        one, else measured now. The backend's options and the record hold the count."""
        backend = self.backend
        if not autotune.asks_auto(backend):
            return self
        if previous is None and self.resume is not None:
            previous = self.resume.resolved
        count, figures = autotune.chosen_before(previous, backend), None
        if count is None:
            count, figures = measure_auto_count(self.loader_spec("train"), backend)
        elif self.dist.rank == 0:
            LOGGER.info(
                f"{autotune.tuned_key(backend)} = auto: {count}, as this run chose at "
                "its start (not measured again)"
            )
        assert backend.knob is not None  # asks_auto said so
        ctx = self.with_resolved(**{backend.knob[1]: count})
        return dataclasses.replace(ctx, backend=autotune.with_count(backend, count), autotune=figures)

    @property
    def num_classes(self) -> int:
        return class_count(self.recipe, self.dataset)

    @property
    def class_names(self) -> list[str]:
        """Each label's name, in label order: train's class folders (or the shard manifest's);
        a label beyond them (synthetic data, a larger model.num_classes) is named by its number."""
        known = list(self.dataset.classes) if self.dataset else []
        return known[: self.num_classes] + [str(i) for i in range(len(known), self.num_classes)]

    @property
    def train_samples(self) -> int:
        return len(self.dataset.splits["train"]) if self.dataset else self.recipe.data.synthetic_samples

    @property
    def global_batch(self) -> int:
        t = self.recipe.train
        return t.batch_size * t.accum_steps * self.dist.world_size

    def loader_spec(self, split: str) -> LoaderSpec:
        """What this rank's loader of `split` ("train" or "val") is built from, by any backend:
        the recipe's facts, the listed dataset, the backend's typed options and the precision
        as decided (images arrive in its autocast dtype)."""
        recipe, dataset, backend = self.recipe, self.dataset, self.backend
        if dataset is None and backend.needs_data:
            raise BackendError(f"loader backend {backend.name!r} needs data.root; set --set data.root=PATH")
        return LoaderSpec(
            split=split,
            listing=dataset.splits[split] if dataset else None,
            num_classes=self.num_classes,
            augment=recipe.augment,
            loader=recipe.loader,
            batch_size=recipe.train.batch_size,
            seed=recipe.train.seed,
            device=self.device,
            dtype=loader_dtype(self.resolved.precision, self.device),
            channels_last=recipe.train.channels_last,
            dist=self.dist,
            max_pixels=recipe.data.max_pixels,
            on_error=recipe.data.on_error,
            synthetic_samples=recipe.data.synthetic_samples,
            sources=dataset.sources if dataset else (),
            checked_by=dataset.checked_by if dataset else None,
            options=backend.options,
        )

    def loader(self, split: str) -> Loader:
        """This rank's loader of `split`, from the resolved backend."""
        return build_loader(self.loader_spec(split), self.backend)

    def facts(self) -> dict[str, Any]:
        """What produced a summary's figures: backend, device, resolved precision, world, batch."""
        return {
            "backend": self.resolved.backend,
            "device": str(self.device),
            "precision": self.resolved.precision,
            "world_size": self.dist.world_size,
            "stallfree_version": __version__,
            "global_batch": self.global_batch,
        }


def prepare_recipe(recipe: Recipe, dist: DistInfo, device: torch.device | None = None) -> RunContext:
    """Decide the run's settings for `recipe` (checked once by whoever read it: recipe.validate
    and registry.check_data_root): the device (`device`, when the caller names one exactly,
    else `train.device` for this rank), the precision and the loader backend on it (once,
    `--loader auto` included). Cheap, no data (a finished run's requeue exits after this)."""
    recipe = recipe.copy()  # the context's own: a caller's later change does not reach it
    device = device if device is not None else resolve_device(recipe.train.device, dist)
    if device.type == "cuda":
        # Shapes are fixed (training drops the short last batch): autotuned convolutions pay off.
        torch.backends.cudnn.benchmark = True
    # resolve_precision hands back its input or one of bf16/fp16/fp32
    precision = cast(Any, resolve_precision(recipe.train.precision, device))
    _check_trackers(recipe.train.trackers)
    loader = resolve_auto(recipe.loader, device, dist, say=True)
    backend = registry.resolve(loader)  # the one resolution; a plug-in's table checked now
    plugin = backend.options if backend.entry is None and backend.options is not None else None
    resolved = Resolved(
        device=cast(Any, device.type),
        precision=precision,
        backend=loader.backend,
        wraps=backend.inner.name if backend.inner is not None else "",
        dali_decode=loader.dali.decode,
        micro_batch=recipe.train.micro_batch,
        # which store the run read (no credential)
        endpoint_url=recipe.data.endpoint_url or storage.endpoint_used(data_root(recipe.data)),
        # a plug-in's options with their defaults filled in: every value used
        plugin=dataclasses.asdict(plugin) if plugin is not None else {},
    )
    return RunContext(recipe, device, dist, backend, resolved)


def _check_trackers(trackers: Sequence[str]) -> None:
    """A tracker asked for must import now, before anything is written."""
    from stallfree.metrics import TRACKERS

    for name in trackers:
        if importlib.util.find_spec(name) is None:
            raise RecipeError(
                f"train.trackers includes {name!r} but it is not installed: pip "
                f"install {TRACKERS[name][1]} (or 'stallfree[track]'), or remove "
                "it from train.trackers"
            )


def prepare(recipe: Recipe, dist: DistInfo | None = None, previous: Resolved | None = None) -> RunContext:
    """`prepare_recipe`, then the dataset, listed once, and a `workers`/`threads = "auto"`
    decided once (eval, bench): every loader of the context is built with that count.
    `previous`: a checkpoint's record, whose count is taken rather than measured again."""
    return prepare_recipe(recipe, dist or DistInfo()).with_dataset().with_loader_counts(previous)
