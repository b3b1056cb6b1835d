"""The run context and the builders: recipe -> resolved facts -> model, optimizer, schedule and
Trainer. Shared by `train`, `eval` and `bench`, so each fact has one place where it is worked out.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import warnings
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from stallfree.data import autotune, registry, storage
from stallfree.data.build import build_loader, measure_auto_count
from stallfree.data.choose import resolve_auto
from stallfree.data.loader import Loader
from stallfree.data.readers.folders import Dataset, class_count, resolve_dataset
from stallfree.data.readers.inflight import reads_in_flight
from stallfree.data.registry import AUTO, ResolvedBackend
from stallfree.log import LOGGER
from stallfree.metrics import SinkSet
from stallfree.models import build_model
from stallfree.models.init import init_from
from stallfree.parallel import DistInfo
from stallfree.recipe import Device, Precision, Recipe, RecipeError, validate
from stallfree.train.checkpoint import ResumePoint
from stallfree.train.distributed import resolve_device, wrap_model
from stallfree.train.ema import ModelEma
from stallfree.train.microbatch import MicroBatcher
from stallfree.train.mix import Mixer
from stallfree.train.precision import resolve_precision
from stallfree.train.schedule import build_optimizer, warmup_cosine
from stallfree.train.trainer import Trainer, TrainerConfig
from stallfree.version import __version__


@dataclasses.dataclass(frozen=True, slots=True)
class RunContext:
    """One run's resolved facts: the recipe with every "auto" decided, the device, the ranks,
    the loader backend (resolved once: name, builder, typed options, tuned count) and (once
    listed) the dataset. Everything derived from them is a property here."""

    recipe: Recipe
    device: torch.device
    dist: DistInfo
    backend: ResolvedBackend
    dataset: Dataset | None = None
    autotune: dict[str, Any] | None = None  # what workers/threads = "auto" measured, if it did
    resume: ResumePoint | None = None  # the checkpoint the run continues from, if any

    @property
    def resuming(self) -> bool:
        """Whether the run continues from a checkpoint (whose weights are loaded later)."""
        return self.resume is not None

    def with_resume(self, found: ResumePoint | None) -> RunContext:
        """This context continuing from `found` (None: a fresh start)."""
        return dataclasses.replace(self, resume=found)

    def with_dataset(self) -> RunContext:
        """This context with the dataset listed (once; the slow part of a start). Resuming: an
        s3:// root's cached listing, the one the run started with, is used."""
        if self.dataset is not None or not self.recipe.data.root:
            return self
        data, seed = self.recipe.data, self.recipe.train.seed
        dataset = resolve_dataset(data, seed=seed, reuse_listing=self.resuming)
        loader = self.recipe.loader  # the context's own copy (prepare_recipe's), which the run records
        if loader.io_depth == "auto":
            loader.io_depth = reads_in_flight(AUTO, dataset.splits["train"].prefix)
            loader.io_depth_requested = "auto"
        return dataclasses.replace(self, dataset=dataset)

    def with_loader_counts(self, previous: dict[str, Any] | None = None) -> RunContext:
        """This context with a `workers`/`threads = "auto"` decided: the count the run chose at
        its start when `previous` (a checkpoint's recipe; by default the resumed one's) holds
        one, else measured now. The recipe keeps the count, "auto" beside it as the request,
        so recipe.toml says what ran."""
        backend = self.backend
        if not autotune.asks_auto(backend):
            return self
        if previous is None and self.resume is not None:
            previous = self.resume.state["recipe"]
        count, figures = autotune.chosen_before(previous, backend), None
        if count is None:
            count, figures = measure_auto_count(
                self.recipe, backend, device=self.device, dist=self.dist, dataset=self.dataset
            )
        elif self.dist.rank == 0:
            LOGGER.info(
                f"{autotune.tuned_key(backend)} = auto: {count}, as this run chose at "
                "its start (not measured again)"
            )
        recipe = self.recipe.copy()
        autotune.record(recipe.loader, backend, count)
        assert backend.knob is not None  # asks_auto said so
        # The same resolution, its typed table now the recipe copy's (which holds the count).
        backend = dataclasses.replace(backend, options=getattr(recipe.loader, backend.knob[0]))
        return dataclasses.replace(self, recipe=recipe, backend=backend, autotune=figures)

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

    def loader(self, split: str) -> Loader:
        """This rank's loader of `split`, from the recipe's `loader.backend`."""
        return build_loader(
            self.recipe, split, device=self.device, dist=self.dist, dataset=self.dataset, backend=self.backend
        )

    def facts(self) -> dict[str, Any]:
        """What produced a summary's figures: backend, device, resolved precision, world, batch."""
        return {
            "backend": self.recipe.loader.backend,
            "device": str(self.device),
            "precision": self.recipe.train.precision,
            "world_size": self.dist.world_size,
            "stallfree_version": __version__,
            "global_batch": self.global_batch,
        }


def prepare_recipe(recipe: Recipe, dist: DistInfo, device: torch.device | None = None) -> RunContext:
    """Validate the recipe, pick the device (`device`, when the caller names one exactly, else
    `train.device` for this rank), resolve `precision` and the loader backend on it (once,
    `--loader auto` included): cheap, no data (a finished run's requeue exits after this)."""
    recipe = recipe.copy()
    _ask_again(recipe)
    validate(recipe)
    if not recipe.data.endpoint_url:  # recipe.toml says which store the run read (no credential)
        recipe.data.endpoint_url = storage.endpoint_used(recipe.data.root)
    registry.check_data_root(recipe)
    device = device if device is not None else resolve_device(recipe.train.device, dist)
    if device.type == "cuda":
        # Shapes are fixed (training drops the short last batch): autotuned convolutions pay off.
        torch.backends.cudnn.benchmark = True
    t = recipe.train
    if t.device == "auto":
        t.device, t.device_requested = cast(Device, device.type), "auto"
    if t.precision == "auto":
        t.precision_requested = "auto"
    # resolve_precision hands back its input or one of bf16/fp16/fp32: a Precision either way.
    t.precision = cast(Precision, resolve_precision(t.precision, device))
    _check_trackers(recipe.train.trackers)
    resolve_auto(recipe.loader, device, dist, say=True)
    backend = registry.resolve(recipe.loader)  # the one resolution; a plug-in's table checked now
    if backend.entry is None and backend.options is not None:
        # A plug-in's options with their defaults filled in: recipe.toml shows every value used.
        recipe.loader.plugin = dataclasses.asdict(backend.options)
    return RunContext(recipe, device, dist, backend)


def _ask_again(recipe: Recipe) -> None:
    """A recorded "auto" whose answer depends on the machine (the device, its precision, the
    backend the device decodes best with, the micro-batch that fits) is asked again here."""
    asked = (("train", "device"), ("train", "precision"), ("train", "micro_batch"), ("loader", "backend"))
    for table, key in asked:
        owner = getattr(recipe, table)
        if getattr(owner, f"{key}_requested") == "auto":
            setattr(owner, key, "auto")
            setattr(owner, f"{key}_requested", "")


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


def prepare(recipe: Recipe, dist: DistInfo | None = None) -> RunContext:
    """`prepare_recipe`, then the dataset, listed once, and a `workers`/`threads = "auto"`
    measured once (eval, bench): every loader of the context is built with that count."""
    return prepare_recipe(recipe, dist or DistInfo()).with_dataset().with_loader_counts()


def steps_per_epoch(train_batches: int, accum_steps: int) -> int:
    """Optimizer steps in one epoch: the last, shorter window is stepped too."""
    return math.ceil(train_batches / accum_steps)


def sync_batchnorm(model: nn.Module, recipe: Recipe, dist: DistInfo, device: torch.device) -> nn.Module:
    """`train.sync_bn` under DDP: BatchNorm layers that average statistics over all ranks."""
    if not recipe.train.sync_bn or dist.world_size <= 1:
        return model
    if device.type != "cuda":
        raise RecipeError(
            "train.sync_bn = true needs CUDA devices (SyncBatchNorm does not run "
            "on the CPU); set it to false for a CPU run"
        )
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def build_trainer(
    ctx: RunContext,
    *,
    train_batches: int,
    sinks: SinkSet | None = None,
    progress: bool = True,
    log_every: int | None = None,
) -> Trainer:
    """Model, optimizer, schedule, mixer and EMA from the run context, in a complete Trainer.

    Resuming (`ctx.resume`): the checkpoint's weights are loaded next, so model.init_from and
    model.pretrained are not read (a requeued job needs the file no longer).
    """
    recipe, device, dist = ctx.recipe, ctx.device, ctx.dist
    model = build_model(recipe.model, ctx.num_classes, load_pretrained=not ctx.resuming)
    if recipe.model.init_from and not ctx.resuming:
        init_from(model, recipe.model.init_from)
    model = sync_batchnorm(model, recipe, dist, device)
    model = model.to(device)
    if recipe.train.channels_last:
        # torch's stubs omit Module.to's memory_format, which it accepts (as `Tensor.to` does)
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    ema = ModelEma(model, recipe.train.ema_decay) if recipe.train.ema_decay > 0 else None
    if recipe.train.compile:
        # Inside DDP: DDP's bucketing sees the compiled graph. A Module in, an OptimizedModule (a
        # Module) out; torch types the result as a bare callable.
        model = cast(nn.Module, torch.compile(model))
    model = wrap_model(model, device, dist)
    opt = recipe.optim
    optimizer = build_optimizer(
        model,
        opt.name,
        lr=opt.lr,
        momentum=opt.momentum,
        weight_decay=opt.weight_decay,
        nesterov=opt.nesterov,
        exclude_norm_bias=opt.wd_exclude_norm_bias,
    )
    total = recipe.train.epochs * steps_per_epoch(train_batches, recipe.train.accum_steps)
    if opt.warmup_steps >= total:
        warnings.warn(
            f"optim.warmup_steps ({opt.warmup_steps}) >= the run's {total} optimizer "
            "steps: the LR never leaves warmup and never decays; lower warmup_steps",
            stacklevel=2,
        )
    scheduler = warmup_cosine(
        optimizer, total_steps=total, warmup_steps=opt.warmup_steps, min_lr_frac=opt.min_lr_frac
    )
    t, aug = recipe.train, recipe.augment
    config = TrainerConfig(
        precision=t.precision,
        accum_steps=t.accum_steps,
        max_grad_norm=t.max_grad_norm,
        log_every=log_every or t.log_every,
        max_nonfinite_steps=t.max_nonfinite_steps,
        label_smoothing=opt.label_smoothing,
        progress=progress,
    )
    mixer = Mixer(
        mixup_alpha=aug.mixup_alpha,
        cutmix_alpha=aug.cutmix_alpha,
        prob=aug.mix_prob,
        seed=t.seed,
        rank=dist.rank,
    )
    micro = MicroBatcher(
        size=t.micro_batch if isinstance(t.micro_batch, int) else 0, auto=t.micro_batch == "auto"
    )
    return Trainer(
        model,
        optimizer,
        scheduler,
        config=config,
        device=device,
        dist=dist,
        sinks=sinks,
        mixer=mixer,
        ema=ema,
        micro=micro,
    )
