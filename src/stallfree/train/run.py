"""`stallfree train`: recipe -> loaders -> model -> Trainer -> run directory and checkpoints."""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from stallfree import __version__
from stallfree.data.listing import Listing, list_split
from stallfree.data.loader import DistInfo, Loader, build_loader
from stallfree.metrics import GpuMonitor, Sink, open_sinks, write_json_atomic
from stallfree.models import build_model
from stallfree.recipe import Recipe, dump_toml, validate
from stallfree.train.checkpoint import Checkpointer
from stallfree.train.profile import StepProfiler
from stallfree.train.distributed import init_distributed, resolve_device, shutdown, wrap_model
from stallfree.train.resume import (StopSignal, check_compatible, find_resume, restore,
                                    training_state)
from stallfree.train.schedule import build_optimizer, warmup_cosine
from stallfree.train.trainer import PreemptedError, Trainer, TrainerConfig


def seed_everything(seed: int, rank: int) -> None:
    """Same model init on every rank (DDP broadcasts it anyway); per-rank streams elsewhere."""
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed)


def train(recipe: Recipe, out_dir: str | Path, *, progress: bool = True,
          resume: str | None = None, force: bool = False, profile_steps: int = 0) -> dict[str, Any]:
    """Run the recipe; write recipe.toml, metrics.jsonl, summary.json and checkpoints/.

    `profile_steps` > 0 traces that many optimizer steps after a warm-up into profile/.

    Raises PreemptedError after saving a checkpoint when SIGTERM or SIGUSR1 arrives.
    """
    validate(recipe, needs_data=recipe.loader.backend != "synthetic" or bool(recipe.data.root))
    started = time.perf_counter()
    # The device type picks the process-group backend; the rank then picks the device index.
    dist = init_distributed(resolve_device(recipe.train.device, DistInfo()).type)
    device = resolve_device(recipe.train.device, dist)
    seed_everything(recipe.train.seed, dist.rank)
    run_dir = Path(out_dir)
    if dist.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "recipe.toml").write_text(dump_toml(recipe))
    listings = _listings(recipe)
    loaders = {s: build_loader(recipe, s, device=device, dist=dist, listing=listings[s])
               for s in ("train", "val")}
    sinks: list[Sink] = open_sinks(run_dir) if dist.rank == 0 else []
    checkpointer = Checkpointer(run_dir / "checkpoints", keep=recipe.train.keep_checkpoints,
                                rank=dist.rank)
    all_ranks_here = False  # a finished or agreed-preempted run: safe to leave the group
    try:
        trainer = build_trainer(recipe, len(loaders["train"]), num_classes(recipe, listings["train"]),
                                device, dist, sinks, progress)
        start_epoch = 0
        found = find_resume(resume, checkpointer) if resume else None
        if found is not None:
            state, path = found
            check_compatible(state, recipe, dist.world_size, path, force)
            start_epoch = restore(state, trainer, loaders["train"], dist.rank)
            if progress and dist.rank == 0:
                tqdm.write(f"resumed from {path} at epoch {start_epoch}, step {trainer.optimizer_steps}")
        monitor = GpuMonitor.maybe(device)
        if monitor is not None:
            trainer.record_extras.append(monitor.sample)
        with StepProfiler(run_dir / "profile", profile_steps, device, dist.rank) as profiler:
            try:
                summary = _fit(trainer, loaders, checkpointer, recipe, dist, start_epoch, profiler)
            except PreemptedError:
                all_ranks_here = True
                raise
            all_ranks_here = True
    finally:
        for item in (*loaders.values(), *sinks):
            item.close()
        if all_ranks_here:
            shutdown()
    summary.update(wall_s=time.perf_counter() - started, backend=recipe.loader.backend,
                   device=str(device), world_size=dist.world_size, stallfree_version=__version__,
                   global_batch=recipe.train.batch_size * recipe.train.accum_steps * dist.world_size,
                   checkpoint_save_s=checkpointer.last_save_s)
    if dist.rank == 0:
        write_json_atomic(run_dir / "summary.json", summary)
    return summary


def _fit(trainer: Trainer, loaders: dict[str, Loader], checkpointer: Checkpointer,
         recipe: Recipe, dist: DistInfo, start_epoch: int, profiler: StepProfiler) -> dict[str, Any]:
    """fit() with periodic, epoch-end and on-signal checkpoints, and the profiler's clock."""
    def save(loader_state: dict[str, Any]) -> None:
        state = training_state(trainer, loader_state, recipe, dist.world_size)
        checkpointer.save(state, trainer.optimizer_steps)

    every = recipe.train.ckpt_every_steps

    def on_step(t: Trainer, loader: Loader) -> None:
        profiler.step()
        if every and t.optimizer_steps % every == 0:
            save(loader.state_dict())

    trainer.on_step = on_step
    # After validation: the next epoch starts from its first batch.
    trainer.on_epoch_end = lambda t, epoch: save({"epoch": epoch + 1, "position": 0})
    with StopSignal() as stop:
        trainer.stop_requested = lambda: stop.requested
        try:
            return trainer.fit(loaders["train"], loaders["val"], epochs=recipe.train.epochs,
                               start_epoch=start_epoch)
        except PreemptedError:
            # Saved even if on_step just did: a rare, atomic rewrite beats tracking boundaries.
            save(loaders["train"].state_dict())
            raise


def build_trainer(recipe: Recipe, train_batches: int, num_classes: int, device: torch.device,
                  dist: DistInfo, sinks: list[Sink], progress: bool = True) -> Trainer:
    """Model, optimizer and schedule from the recipe, wrapped in a Trainer."""
    model = build_model(recipe.model, num_classes).to(device)
    if recipe.train.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = wrap_model(model, device, dist)
    opt = recipe.optim
    optimizer = build_optimizer(model, opt.name, lr=opt.lr, momentum=opt.momentum,
                                weight_decay=opt.weight_decay)
    steps_per_epoch = math.ceil(train_batches / recipe.train.accum_steps)
    scheduler = warmup_cosine(optimizer, total_steps=recipe.train.epochs * steps_per_epoch,
                              warmup_steps=opt.warmup_steps, min_lr_frac=opt.min_lr_frac)
    return Trainer(model, optimizer, scheduler, config=trainer_config(recipe, progress),
                   device=device, sinks=sinks, dist=dist)


def trainer_config(recipe: Recipe, progress: bool = True) -> TrainerConfig:
    """The Trainer's slice of the recipe."""
    t = recipe.train
    return TrainerConfig(precision=t.precision, accum_steps=t.accum_steps,
                         max_grad_norm=t.max_grad_norm, log_every=t.log_every,
                         max_nonfinite_steps=t.max_nonfinite_steps,
                         label_smoothing=recipe.optim.label_smoothing, progress=progress)


def _listings(recipe: Recipe) -> dict[str, Listing | None]:
    if not recipe.data.root:
        return {"train": None, "val": None}
    return {s: list_split(recipe.data.root, s, recipe.data.file_list or None) for s in ("train", "val")}


def num_classes(recipe: Recipe, train_listing: Listing | None) -> int:
    """model.num_classes, else the class folders of the training split, else the synthetic count."""
    if recipe.model.num_classes:
        return recipe.model.num_classes
    return len(train_listing.classes) if train_listing else recipe.data.synthetic_classes
