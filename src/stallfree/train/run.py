"""`stallfree train`: recipe -> dataset -> loaders -> Trainer -> run directory and checkpoints.

Everything that can fail on bad input (recipe, device, dataset, backend, resume target, output
directory) is checked before anything is written, so a failed start leaves no half-made run.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from stallfree.data.loader import Loader
from stallfree.data.readers.folders import held_out_record
from stallfree.data.readers.paths import data_root
from stallfree.log import LOGGER
from stallfree.metrics import GpuMonitor, SinkSet, write_json_atomic
from stallfree.parallel import DistInfo
from stallfree.recipe import Recipe, RecipeError, dump_toml
from stallfree.train.assemble import build_trainer, steps_per_epoch
from stallfree.train.checkpoint import Checkpointer, SavedCheckpoint
from stallfree.train.checkpoint.manager import CheckpointManager
from stallfree.train.checkpoint.parts import StepMark
from stallfree.train.distributed import all_reduce_sum, init_distributed, peer_ended_first, shutdown
from stallfree.train.listing_check import check_ranks_agree
from stallfree.train.microbatch import probe_micro_batch
from stallfree.train.outage import (
    StoreOutage,
    can_save,
    outage_as_stop,
    outage_error_without_save,
    retries_record,
)
from stallfree.train.prepare import RunContext, prepare_recipe
from stallfree.train.profile import StepProfiler
from stallfree.train.progress import TimeToGo
from stallfree.train.resume import check_compatible, check_same_data, data_record, find_resume
from stallfree.train.rundir import RunDir
from stallfree.train.signals import StopSignal
from stallfree.train.trainer import MicroBatchOOMError, PreemptedError, Trainer, TrainerHooks


def seed_everything(seed: int, rank: int) -> None:
    """Same model init on every rank (DDP broadcasts it anyway); per-rank streams elsewhere."""
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed)


def _flat(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The recipe as "section.key" -> value: a tracker's run parameters."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


@dataclass(slots=True)
class SegmentClock:
    """Wall time over a run's segments (each start that trains; a requeue adds one): the
    checkpoint carries the earlier ones' time, up to their last save, so summary.json's
    wall_s is the whole run's, not the last segment's."""

    started: float
    earlier_s: float = 0.0
    earlier: int = 0

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the earlier segments from a checkpoint (an older one holds none: zero)."""
        self.earlier_s, self.earlier = float(state["wall_s"]), int(state["count"])

    def state_dict(self) -> dict[str, Any]:
        return {"wall_s": self.wall_s(), "count": self.earlier + 1}

    def wall_s(self) -> float:
        return self.earlier_s + time.perf_counter() - self.started


def _check_batches(loader: Loader, ctx: RunContext) -> None:
    if len(loader) == 0:
        raise RecipeError(
            f"train.batch_size {ctx.recipe.train.batch_size} x {ctx.dist.world_size} rank(s) is "
            f"more than the {ctx.train_samples} images of the training split; lower "
            "train.batch_size"
        )


def train(
    recipe: Recipe,
    out_dir: str | Path | None,
    *,
    name: str = "run",
    progress: bool = True,
    resume: str | None = None,
    force: bool = False,
    profile_steps: int = 0,
) -> dict[str, Any]:
    """Run the recipe (checked by the caller: recipe.validate, registry.check_data_root); write
    recipe.toml, resolved.toml, metrics.jsonl, summary.json and checkpoints/ into `out_dir`
    (None: runs/<name>-<the backend that runs>-<time>, named in the summary's run_dir).

    `profile_steps` > 0 traces that many optimizer steps after a warm-up into profile/.
    Raises PreemptedError after saving a checkpoint when a stop signal arrives.
    """
    clock = SegmentClock(started=time.perf_counter())
    dist = DistInfo.from_env()
    run = RunDir(out_dir) if out_dir is not None else None
    if run is not None and dist.rank == 0:
        # Before any check: a start that fails must not leave an old marker that tells a
        # requeue loop to go round again.
        run.clear_preempted()
    ctx = prepare_recipe(recipe, dist)
    recipe = ctx.recipe
    if run is None:  # named once "auto" is decided: the folder says which backend ran
        run = RunDir(f"runs/{name}-{ctx.resolved.backend}-{time.strftime('%Y%m%d-%H%M%S')}")
    run.check_writable()
    checkpointer = Checkpointer(run.checkpoints, keep=recipe.train.keep_checkpoints, rank=dist.rank)
    found = find_resume(resume, checkpointer) if resume else None
    if found is None:
        run.check_fresh_start(resume)
    else:
        check_compatible(found, recipe, ctx.resolved, dist.world_size, force)
        if found.epoch >= recipe.train.epochs:
            # A requeued job that had finished: exit before any listing, with its summary.
            LOGGER.info(
                f"{out_dir} holds a finished run (epoch {found.epoch} of "
                f"{recipe.train.epochs}); nothing to do"
            )
            return run.finished_summary()
    # The checkpoint travels with the context: a resume reuses its listing and its record's
    # "auto" worker/thread counts, and loads no pretrained or init_from weights.
    ctx = ctx.with_resume(found).with_dataset().with_loader_counts()
    data = data_record(ctx.dataset)  # once: a digest of every train file's name and label
    if found is not None:
        check_same_data(found, data, ctx.dataset, force)
    seed_everything(recipe.train.seed, dist.rank)
    init_distributed(dist, ctx.device)
    check_ranks_agree(ctx.dataset, data, dist.rank, dist.world_size)  # nodes list on their own
    begun = _Begun(run=run, ctx=ctx, checkpointer=checkpointer, found=found, data=data, clock=clock)
    return _train_in_group(begun, progress=progress, profile_steps=profile_steps)


@dataclass(kw_only=True, slots=True)
class _Begun:
    """What a run's checks have settled before its loaders and trainer are built."""

    run: RunDir
    ctx: RunContext
    checkpointer: Checkpointer
    found: SavedCheckpoint | None
    data: dict[str, Any]
    clock: SegmentClock


def _train_in_group(begun: _Begun, *, progress: bool, profile_steps: int) -> dict[str, Any]:
    """Loaders, trainer and checkpoints built, the run trained, and its summary written; every
    rank leaves the group where all of them arrive (a finished or an agreed-preempted run)."""
    run, ctx, found, dist = begun.run, begun.ctx, begun.found, begun.ctx.dist
    loaders: dict[str, Loader] = {}
    sinks = SinkSet()
    all_ranks_here = False  # a finished or agreed-preempted run: safe to leave the group
    try:
        for split in ("train", "val"):
            loaders[split] = ctx.loader(split)
        _check_batches(loaders["train"], ctx)
        trainer = build_trainer(ctx, train_batches=len(loaders["train"]), sinks=sinks, progress=progress)
        if ctx.recipe.train.micro_batch == "auto" and dist.world_size > 1:
            trainer.micro.size = _probe_micro_batch(trainer, ctx.recipe, ctx.device)
            # resolved.toml and the checkpoints say the size found (a resume probes again).
            ctx = ctx.with_resolved(micro_batch=trainer.micro.size)
        # The last step's loader positions (an outage gives back the rest).
        mark = StepMark(loaders["train"])
        ckpt = CheckpointManager.for_run(begun.checkpointer, trainer, mark, begun.clock, ctx, begun.data)
        if found is not None:
            ckpt.load(found)
        start_epoch = loaders["train"].epoch  # the loader keeps the epoch (a resume's, or 0)
        _barrier_after_checks()
        if dist.rank == 0:
            _write_start(run, ctx, found, sinks)
        _announce(ctx, found, start_epoch, trainer)
        summary = _run(trainer, loaders, run, ctx, start_epoch, profile_steps, ckpt, mark)
        all_ranks_here = True
    except PreemptedError as exc:
        all_ranks_here = True
        exc.run_dir = str(run.path)  # where to resume, when the run named its folder
        raise
    except Exception as exc:
        # Named to the other ranks before this one's connections close (distributed.py).
        peer_error = peer_ended_first(dist.rank, exc)
        if peer_error is not None:
            raise peer_error from None
        raise
    finally:
        for loader in loaders.values():
            loader.close()
        sinks.close()
        if all_ranks_here:
            shutdown()
    summary.update(
        wall_s=begun.clock.wall_s(),
        segments=begun.clock.earlier + 1,
        checkpoint_save_s=begun.checkpointer.last_save_s,
        run_dir=str(run.path),
        **ctx.facts(),
    )
    if dist.rank == 0:
        write_json_atomic(run.path / "summary.json", summary)
    return summary


def _write_start(run: RunDir, ctx: RunContext, found: SavedCheckpoint | None, sinks: SinkSet) -> None:
    """Rank 0's files of a run's start: recipe.toml, resolved.toml, the sinks, autotune.json
    and val_holdout.txt."""
    recipe = ctx.recipe
    run.start(dump_toml(recipe), ctx.resolved.to_toml(), found.metrics_records if found else 0)
    params = {**recipe.to_dict(), "resolved": ctx.resolved.to_dict()}
    sinks.open(run.path, tuple(recipe.train.trackers), _flat(params))
    if ctx.autotune:  # what workers/threads = "auto" measured and chose
        write_json_atomic(run.path / "autotune.json", ctx.autotune)
    if recipe.data.val_fraction and ctx.dataset is not None:  # which train files val holds
        held = held_out_record(ctx.dataset, recipe.data.val_fraction, recipe.train.seed)
        (run.path / "val_holdout.txt").write_text(held)


def _probe_micro_batch(trainer: Trainer, recipe: Recipe, device: torch.device) -> int:
    """Under DDP: the chunk size every rank can run, found once before training."""
    model, size = trainer.model, max(recipe.augment.sizes())  # the largest the run will use
    buffers = [b.clone() for b in model.buffers()]  # the probe must not move BatchNorm stats
    memory_format = torch.channels_last if recipe.train.channels_last else torch.contiguous_format

    def step(n: int) -> None:
        images = torch.zeros((n, 3, size, size), device=device).to(memory_format=memory_format)
        try:
            with cast(Any, model).no_sync(), trainer.policy.autocast():  # DDP's no_sync
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
        raise MicroBatchOOMError(
            "train.micro_batch = auto: not even one image fits on some "
            "rank's device; use a smaller model or image size"
        )
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


def _announce(ctx: RunContext, found: SavedCheckpoint | None, start_epoch: int, trainer: Trainer) -> None:
    if ctx.dist.rank != 0:
        return
    resolved = ctx.resolved  # what ran, "auto" decided (resolved.toml)
    micro = f", micro-batch {resolved.micro_batch}" if resolved.micro_batch else ""
    LOGGER.info(
        f"{resolved.described()}, {ctx.recipe.model.name}, {ctx.device}, "
        f"precision {resolved.precision}{micro}, world size {ctx.dist.world_size}, "
        f"global batch {ctx.global_batch}"
    )
    if found is not None:
        LOGGER.info(f"resumed from {found.path} at epoch {start_epoch}, step {trainer.optimizer_steps}")


def _run(
    trainer: Trainer,
    loaders: dict[str, Loader],
    run: RunDir,
    ctx: RunContext,
    start_epoch: int,
    profile_steps: int,
    ckpt: CheckpointManager,
    mark: StepMark,
) -> dict[str, Any]:
    """fit() with `ckpt`'s periodic, epoch-end and on-signal checkpoints (`mark`: the train
    loader's part), and the profiler's clock."""
    recipe, device, dist = ctx.recipe, ctx.device, ctx.dist
    train_loader = loaders["train"]

    eta = TimeToGo(
        trainer, recipe.train.epochs * steps_per_epoch(len(train_loader), recipe.train.accum_steps)
    )
    extras = _record_extras(ctx, train_loader)
    with (
        StepProfiler(run.path / "profile", profile_steps, device, dist.rank) as profiler,
        StopSignal() as stop,
    ):

        def on_step(t: Trainer) -> None:
            mark.step()
            profiler.step()
            eta.step()
            ckpt.on_step(t.optimizer_steps)

        def on_epoch_end(t: Trainer, epoch: int) -> None:
            ckpt.on_epoch_end(t.optimizer_steps, epoch, t.improved)

        hooks = TrainerHooks(
            on_step=on_step,
            on_epoch_end=on_epoch_end,
            stop_requested=lambda: stop.requested is not None,
            record_extras=extras,
        )
        try:
            with outage_as_stop():  # a store down past its budget: a stop (train/outage.py)
                return trainer.fit(
                    train_loader,
                    loaders["val"],
                    epochs=recipe.train.epochs,
                    start_epoch=start_epoch,
                    hooks=hooks,
                )
        except PreemptedError as exc:
            _save_on_stop(exc, stop.requested, trainer, run, ckpt, mark)
            raise


def _record_extras(ctx: RunContext, train_loader: Loader) -> list[Callable[[], dict[str, Any]]]:
    """What each log record adds beside the step's figures: GPU use, skipped samples, store
    retries."""
    recipe, device = ctx.recipe, ctx.device
    extras: list[Callable[[], dict[str, Any]]] = []
    monitor = GpuMonitor.maybe(device)
    if monitor is not None:
        extras.append(monitor.sample)
    if recipe.data.on_error == "skip":
        extras.append(lambda: {"skipped_samples": _skipped(train_loader, device)})
    retries = retries_record(data_root(recipe.data), device)
    if retries is not None:
        extras.append(retries)
    return extras


def _save_on_stop(
    exc: PreemptedError,
    requested: str | None,
    trainer: Trainer,
    run: RunDir,
    ckpt: CheckpointManager,
    mark: StepMark,
) -> None:
    """A stop's checkpoint and the preempted marker a requeue loop reads (`requested`: the
    signal that asked for it)."""
    if not can_save(exc, trainer.dist.world_size):
        raise outage_error_without_save(exc) from None  # an error: no closing barrier (train/outage.py)
    mark.rewind = isinstance(exc, StoreOutage)  # an outage saves as of the last step
    ckpt.on_stop(trainer.optimizer_steps)
    exc.signal = exc.signal if isinstance(exc, StoreOutage) else requested or "SIGTERM"
    if trainer.dist.rank == 0 and exc.signal != "SIGINT":
        run.mark_preempted(
            {
                "signal": exc.signal,
                "step": trainer.optimizer_steps,
                "checkpoint": str(ckpt.newest()),
                **({"reason": str(exc)} if isinstance(exc, StoreOutage) else {}),
            }
        )
