"""`stallfree train`: recipe -> dataset -> loaders -> Trainer -> run directory and checkpoints.

Everything that can fail on bad input (recipe, device, dataset, backend, resume target, output
directory) is checked before anything is written, so a failed start leaves no half-made run.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stallfree import __version__
from stallfree.data.auto import choose_backend
from stallfree.data.dataset import Dataset, resolve_dataset
from stallfree.data.loader import Loader, build_loader
from stallfree.log import LOGGER
from stallfree.metrics import GpuMonitor, JsonlSink, Sink, open_sinks, write_json_atomic
from stallfree.parallel import DistInfo
from stallfree.recipe import Recipe, RecipeError, apply_overrides, dump_toml, validate
from stallfree.train.build import build_trainer, steps_per_epoch
from stallfree.train.checkpoint import Checkpointer
from stallfree.train.distributed import all_reduce_sum, init_distributed, resolve_device, shutdown
from stallfree.train.precision import resolve_precision
from stallfree.train.profile import StepProfiler
from stallfree.train.resume import StopSignal, check_compatible, find_resume, restore, training_state
from stallfree.train.rundir import RunDir
from stallfree.train.microbatch import probe_micro_batch
from stallfree.train.trainer import MicroBatchOOMError, PreemptedError, Trainer


def seed_everything(seed: int, rank: int) -> None:
    """Same model init on every rank (DDP broadcasts it anyway); per-rank streams elsewhere."""
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed)


def prepare_recipe(recipe: Recipe, dist: DistInfo) -> tuple[Recipe, torch.device]:
    """Validate the recipe, pick the device and resolve `precision = auto`: cheap, no data."""
    recipe = recipe.copy()
    validate(recipe)
    device = resolve_device(recipe.train.device, dist)
    if device.type == "cuda":
        # Shapes are fixed (training drops the short last batch): autotuned convolutions pay off.
        torch.backends.cudnn.benchmark = True
    recipe.train.precision = resolve_precision(recipe.train.precision, device)
    if recipe.loader.backend == "auto" or (recipe.loader.backend == "synthetic-decode"
                                           and recipe.loader.synthetic_decode == "auto"):
        recipe = resolve_auto_loader(recipe, device, dist)
    return recipe, device


def resolve_auto_loader(recipe: Recipe, device: torch.device, dist: DistInfo) -> Recipe:
    """`loader.backend = "auto"` (and synthetic-decode's "auto") resolved for this device; the
    choice and its reason are said once, and the run directory's recipe holds the choice."""
    backend, sets, why = choose_backend(device, dist.local_world_size)
    if recipe.loader.backend == "synthetic-decode":
        recipe.loader.synthetic_decode = backend
    if recipe.loader.backend == "auto":
        recipe = apply_overrides(recipe, [f"loader.backend={backend}", *sets])
        if dist.rank == 0:
            LOGGER.info(f"--loader auto: {backend} ({why})")
    return recipe


def prepare(recipe: Recipe, dist: DistInfo) -> tuple[Recipe, torch.device, Dataset | None]:
    """`prepare_recipe`, then the dataset, resolved once."""
    recipe, device = prepare_recipe(recipe, dist)
    return recipe, device, resolve_dataset(recipe.data) if recipe.data.root else None


def _check_batches(loader: Loader, recipe: Recipe, dist: DistInfo, samples: int) -> None:
    if len(loader) == 0:
        raise RecipeError(
            f"train.batch_size {recipe.train.batch_size} x {dist.world_size} rank(s) is more "
            f"than the {samples} images of the training split; lower train.batch_size")


def train(recipe: Recipe, out_dir: str | Path, *, progress: bool = True,
          resume: str | None = None, force: bool = False, profile_steps: int = 0) -> dict[str, Any]:
    """Run the recipe; write recipe.toml, metrics.jsonl, summary.json and checkpoints/.

    `profile_steps` > 0 traces that many optimizer steps after a warm-up into profile/.
    Raises PreemptedError after saving a checkpoint when a stop signal arrives.
    """
    started = time.perf_counter()
    dist = DistInfo.from_env()
    run = RunDir(out_dir)
    if dist.rank == 0:
        # Before any check: a start that fails must not leave an old marker that tells a
        # requeue loop to go round again.
        run.clear_preempted()
    recipe, device = prepare_recipe(recipe, dist)
    run.check_writable()
    checkpointer = Checkpointer(run.checkpoints, keep=recipe.train.keep_checkpoints, rank=dist.rank)
    found = find_resume(resume, checkpointer) if resume else None
    if found is None:
        run.check_fresh_start(resume)
    else:
        check_compatible(found[0], recipe, dist.world_size, found[1], force)
        if found[0]["epoch"] >= recipe.train.epochs:
            # A requeued job that had finished: exit before any listing, with its summary.
            LOGGER.info(f"{out_dir} holds a finished run (epoch {found[0]['epoch']} of "
                        f"{recipe.train.epochs}); nothing to do")
            return run.finished_summary()
    dataset = resolve_dataset(recipe.data) if recipe.data.root else None
    seed_everything(recipe.train.seed, dist.rank)
    init_distributed(dist, device)
    loaders: dict[str, Loader] = {}
    sinks: list[Sink] = []
    all_ranks_here = False  # a finished or agreed-preempted run: safe to leave the group
    try:
        for split in ("train", "val"):
            loaders[split] = build_loader(recipe, split, device=device, dist=dist, dataset=dataset)
        _check_batches(loaders["train"], recipe, dist, len(dataset.splits["train"]) if dataset
                       else recipe.data.synthetic_samples)
        if dist.rank == 0 and loaders["train"].autotune:
            run.path.mkdir(parents=True, exist_ok=True)
            write_json_atomic(run.path / "autotune.json", loaders["train"].autotune)
        trainer = build_trainer(
            recipe, train_batches=len(loaders["train"]), device=device, dist=dist,
            num_classes=recipe.model.num_classes or (
                dataset.num_classes if dataset else recipe.data.synthetic_classes),
            progress=progress)
        start_epoch = restore(found[0], trainer, loaders["train"], dist.rank, device) \
            if found is not None else 0
        if recipe.train.micro_batch == "auto" and dist.world_size > 1:
            trainer.micro.size = _probe_micro_batch(trainer, recipe, device)
        _barrier_after_checks()
        if dist.rank == 0:
            run.start(dump_toml(recipe), found[0].get("metrics_records", 0) if found else 0)
            sinks = open_sinks(run.path)
            trainer.sinks = sinks
        _announce(recipe, device, dist, found, start_epoch, trainer)
        summary = _run(trainer, loaders, checkpointer, run, recipe, dist, device, start_epoch,
                       profile_steps, sinks)
        all_ranks_here = True
    except PreemptedError:
        all_ranks_here = True
        raise
    finally:
        for item in (*loaders.values(), *sinks):
            item.close()
        if all_ranks_here:
            shutdown()
    summary.update(wall_s=time.perf_counter() - started, checkpoint_save_s=checkpointer.last_save_s,
                   **_run_facts(recipe, device, dist))
    if dist.rank == 0:
        write_json_atomic(run.path / "summary.json", summary)
    return summary


def _run_facts(recipe: Recipe, device: torch.device, dist: DistInfo) -> dict[str, Any]:
    """What produced the summary's figures: backend, device, resolved precision, world, batch."""
    return {"backend": recipe.loader.backend, "device": str(device),
            "precision": recipe.train.precision, "world_size": dist.world_size,
            "stallfree_version": __version__,
            "global_batch": recipe.train.batch_size * recipe.train.accum_steps * dist.world_size}


def _probe_micro_batch(trainer: Trainer, recipe: Recipe, device: torch.device) -> int:
    """Under DDP: the chunk size every rank can run, found once before training."""
    model, size = trainer.model, recipe.augment.image_size
    buffers = [b.clone() for b in model.buffers()]  # the probe must not move BatchNorm stats
    memory_format = torch.channels_last if recipe.train.channels_last else torch.contiguous_format

    def step(n: int) -> None:
        images = torch.zeros((n, 3, size, size), device=device).to(memory_format=memory_format)
        try:
            with model.no_sync(), trainer.policy.autocast():
                model(images).float().sum().backward()
        finally:
            trainer.optimizer.zero_grad(set_to_none=True)
            for buffer, saved in zip(model.buffers(), buffers):
                buffer.copy_(saved)

    def min_over_ranks(n: int) -> int:
        value = torch.tensor([float(n)], device=device)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN)
        return int(value.item())

    found = probe_micro_batch(step, recipe.train.batch_size, min_over_ranks)
    if found < 1:
        raise MicroBatchOOMError("train.micro_batch = auto: not even one image fits on some "
                                 "rank's device; use a smaller model or image size")
    if trainer.dist.rank == 0:
        LOGGER.info(f"train.micro_batch = auto: chunks of {found} on every rank")
    return found


def _skipped(loader: Loader, device: torch.device) -> int:
    """Bad samples every rank has dropped so far (every rank logs at the same steps)."""
    count = torch.tensor([float(getattr(loader, "skipped_samples", 0))], device=device)
    return int(all_reduce_sum(count).item())


def _barrier_after_checks() -> None:
    # No rank writes into the run directory before every rank has finished checking it.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _announce(recipe: Recipe, device: torch.device, dist: DistInfo, found: Any,
              start_epoch: int, trainer: Trainer) -> None:
    if dist.rank != 0:
        return
    LOGGER.info(f"{recipe.loader.backend} loader, {recipe.model.name}, {device}, "
               f"precision {recipe.train.precision}, world size {dist.world_size}, "
               f"global batch {recipe.train.batch_size * recipe.train.accum_steps * dist.world_size}")
    if found is not None:
        LOGGER.info(f"resumed from {found[1]} at epoch {start_epoch}, "
                   f"step {trainer.optimizer_steps}")


class _Eta:
    """Prints once, after the first steps, how long the rest of the run should take."""

    AFTER_STEPS = 10

    def __init__(self, trainer: Trainer, total_steps: int) -> None:
        self.trainer, self.total_steps = trainer, total_steps
        self.first_step, self.started = trainer.optimizer_steps, time.perf_counter()
        self.done = trainer.dist.rank != 0

    def step(self) -> None:
        steps = self.trainer.optimizer_steps - self.first_step
        if self.done or steps < min(self.AFTER_STEPS, self.total_steps - self.first_step):
            return
        self.done = True
        per_step = (time.perf_counter() - self.started) / max(1, steps)
        left = (self.total_steps - self.trainer.optimizer_steps) * per_step
        LOGGER.info(f"about {left / 60:.1f} min to go ({self.total_steps} steps in "
                   f"all at {per_step:.2f} s each; validation not included)")


def _run(trainer: Trainer, loaders: dict[str, Loader], checkpointer: Checkpointer, run: RunDir,
         recipe: Recipe, dist: DistInfo, device: torch.device, start_epoch: int,
         profile_steps: int, sinks: list[Sink]) -> dict[str, Any]:
    """fit() with periodic, epoch-end and on-signal checkpoints, and the profiler's clock."""
    records = next((s for s in sinks if isinstance(s, JsonlSink)), None)
    train_loader = loaders["train"]

    def save() -> None:
        state = training_state(trainer, train_loader.state_dict(), recipe, dist.world_size,
                               device, records.records if records else 0)
        checkpointer.save(state, trainer.optimizer_steps)

    every = recipe.train.ckpt_every_steps
    eta = _Eta(trainer, recipe.train.epochs * steps_per_epoch(len(train_loader),
                                                             recipe.train.accum_steps))
    monitor = GpuMonitor.maybe(device)
    if monitor is not None:
        trainer.record_extras.append(monitor.sample)
    if recipe.data.on_error == "skip":
        trainer.record_extras.append(lambda: {"skipped_samples": _skipped(train_loader, device)})
    with StepProfiler(run.path / "profile", profile_steps, device, dist.rank) as profiler, \
            StopSignal() as stop:

        def on_step(t: Trainer) -> None:
            profiler.step()
            eta.step()
            if every and t.optimizer_steps % every == 0:
                save()

        def on_epoch_end(t: Trainer, epoch: int) -> None:
            train_loader.set_epoch(epoch + 1)  # the next epoch starts from its first batch
            save()

        trainer.on_step, trainer.on_epoch_end = on_step, on_epoch_end
        trainer.stop_requested = lambda: stop.requested is not None
        try:
            return trainer.fit(train_loader, loaders["val"], epochs=recipe.train.epochs,
                               start_epoch=start_epoch)
        except PreemptedError as exc:
            # Saved even if on_step just did: a rare, atomic rewrite beats tracking boundaries.
            save()
            exc.signal = stop.requested or "SIGTERM"
            if dist.rank == 0 and exc.signal != "SIGINT":
                run.mark_preempted({"signal": exc.signal, "step": trainer.optimizer_steps,
                                    "checkpoint": str(checkpointer.paths()[0])})
            raise
