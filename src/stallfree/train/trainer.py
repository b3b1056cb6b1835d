"""The step loop: autocast, backward (no_sync), unscale, clip, step, schedule.

Host syncs: none per micro-step, one per optimizer step (the gradient norm's finite check, in
every precision) and one per log interval (the device-side loss sum); the ranks' stop vote is
read a step late so it costs none (train/signals.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from tqdm import tqdm

from stallfree.data.loader import Batch, Loader
from stallfree.errors import StallfreeError
from stallfree.metrics import Sink, SinkSet, Totals
from stallfree.parallel import DistInfo
from stallfree.train.accuracy import evaluate_model
from stallfree.train.checkpoint.parts import (
    ModelState,
    ScalerState,
    ScheduleState,
    StateFns,
    Stateful,
    load_parts,
    save_parts,
)
from stallfree.train.ema import ModelEma
from stallfree.train.interval import LogWindow, StepTimer
from stallfree.train.microbatch import OUT_OF_MEMORY, MicroBatcher, WindowMark
from stallfree.train.mix import Mixer
from stallfree.train.precision import PrecisionPolicy
from stallfree.train.progress import progress_bar, say_validation, show_interval
from stallfree.train.signals import StopVote


class NonFiniteLossError(StallfreeError, RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


class MicroBatchOOMError(StallfreeError, RuntimeError):
    """The device ran out of memory on one micro-batch."""


class PreemptedError(Exception):
    """A stop was requested (SIGTERM, SIGUSR1 or SIGINT); raised right after an optimizer step."""

    signal, run_dir = "SIGTERM", ""  # which one, and the run's folder: set by train/run.py


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    precision: str = "fp32"
    accum_steps: int = 1
    max_grad_norm: float = 0.0  # 0: measure the norm, do not clip
    log_every: int = 20  # optimizer steps
    max_nonfinite_steps: int = 10
    label_smoothing: float = 0.0
    progress: bool = True


@dataclass(slots=True)
class TrainerHooks:
    """What a run plugs into one `fit`: they live as long as it (a stop signal's handler, the
    profiler), so they are its arguments rather than parts of the Trainer."""

    on_step: Callable[[Trainer], None] | None = None  # after each optimizer step
    on_epoch_end: Callable[[Trainer, int], None] | None = None
    stop_requested: Callable[[], bool] = field(default=lambda: False)
    # Extra fields for each log record, e.g. GPU utilisation from NVML.
    record_extras: list[Callable[[], dict[str, Any]]] = field(default_factory=list)


class Trainer:
    """Trains `model` on any `Loader`; never branches on the backend."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        *,
        config: TrainerConfig,
        device: torch.device,
        dist: DistInfo | None = None,
        sinks: SinkSet | list[Sink] | None = None,
        mixer: Mixer | None = None,
        ema: ModelEma | None = None,
        micro: MicroBatcher | None = None,
    ) -> None:
        """Everything the step loop uses is given here; nothing is set on it afterwards.

        `sinks` may be opened later (`SinkSet.open`, once the run directory is written);
        `mixer` mixes batches after the loader, `ema` keeps an average of the weights, `micro`
        cuts each batch into chunks (train.micro_batch).
        """
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.config, self.device, self.dist = config, device, dist or DistInfo()
        self.sinks = sinks if isinstance(sinks, SinkSet) else SinkSet(sinks)
        self.mixer = mixer if mixer is not None and mixer.enabled else None
        self.ema = ema
        self.micro = micro or MicroBatcher()
        self.policy = PrecisionPolicy(config.precision, device.type)
        self.scaler = self.policy.grad_scaler()
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=config.label_smoothing)
        self.epoch = 0
        self.optimizer_steps = 0  # steps that happened; the schedule's clock
        self.skipped_steps = 0
        self._nonfinite_in_row = 0
        self._step_lr = 0.0  # the LR the last optimizer step used (what a log record reports)
        self._window = LogWindow.zeros(device)
        self._timer = StepTimer()  # the current pass's (train_batches starts one per pass)
        self._stop = StopVote(self.dist, device)  # ranks agree on a requested stop
        self.totals = Totals()
        self.best_val_top1 = -1.0  # the best epoch's val top-1 (checkpointed)
        self.improved = False  # whether the last validation beat every earlier one

    # ---- the step ---------------------------------------------------------------------------
    def _micro_step(self, batch: Batch, window_len: int, boundary: bool, index: int) -> None:
        """Forward and backward one micro-batch; gradients sync only on the window's last one.

        `index` is the micro-batch's place in the epoch, which seeds its mixing. With
        train.micro_batch the batch runs in chunks, each weighted by its share of the batch.
        """
        if batch.labels.numel() == 0:  # every image bad and skipped (data.on_error = skip)
            self._empty_step(batch, boundary)
            return
        mixed = (
            self.mixer(batch.images, batch.labels, epoch=self.epoch, index=index)
            if self.mixer is not None
            else None
        )
        images = batch.images if mixed is None else mixed.images
        n = batch.labels.numel()
        chunks = self.micro.split(n)
        for k, (a, b) in enumerate(chunks):
            last = boundary and k == len(chunks) - 1
            with self._sync(last):
                with self.policy.autocast():
                    logits = self.model(images[a:b])
                # Loss in fp32: softmax over low-precision logits loses accuracy.
                logits = logits.float()
                loss = self.loss_fn(logits, batch.labels[a:b])
                if mixed is not None:  # the mix of the two targets, with label smoothing kept
                    loss = mixed.lam * loss + (1 - mixed.lam) * self.loss_fn(
                        logits, mixed.partner_labels[a:b]
                    )
                # Weighted by the chunk's share of the batch and divided by the window's true
                # length, so the summed gradient is the window mean (short last window too).
                self.scaler.scale(loss * ((b - a) / n / window_len)).backward()
            self._window.loss_sum += loss.detach() * (b - a)
        self._window.samples += n

    def _sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """DDP: gradients all-reduce only on a window's last backward (no_sync on the others)."""
        if last or not hasattr(self.model, "no_sync"):
            return contextlib.nullcontext()
        return cast(Any, self.model).no_sync()  # DDP's; nn.Module's stub types it a Tensor

    def _empty_step(self, batch: Batch, boundary: bool) -> None:
        """A micro-batch with no sample: nothing to learn, but under DDP the boundary backward
        is a collective every rank must join, so an empty forward and a zero loss run it."""
        with self._sync(boundary), self.policy.autocast():
            loss = self.model(batch.images).float().sum() * 0.0
        self.scaler.scale(loss).backward()

    def train_step(self, window: list[Batch], first_index: int) -> bool:
        """One optimizer step on a window of micro-batches (`accum_steps` of them, or fewer at
        the end of a pass); True if the step happened (False: a non-finite gradient, skipped).

        `first_index` is the window's first micro-batch in the epoch (it seeds the mixing).
        Out of memory under train.micro_batch = "auto" (one process): the window's gradients,
        logged sums and buffers are dropped and the same list runs again in smaller chunks, so
        no sample is lost or counted twice, in the weights or in BatchNorm's statistics.
        """
        mark = WindowMark.take(self.model, self._window) if self.micro.auto else None
        while True:
            try:
                for k, batch in enumerate(window):
                    self._micro_step(batch, len(window), k == len(window) - 1, first_index + k)
                break
            except OUT_OF_MEMORY as exc:
                n = max(batch.labels.numel() for batch in window)
                if mark is None or not self.micro.can_back_off(self.dist.world_size, n):
                    raise MicroBatchOOMError(self.micro.oom_message(n, self.config.accum_steps)) from exc
                self.optimizer.zero_grad(set_to_none=True)
                mark.restore(self.model, self._window)
                self.micro.back_off(n)
        return self._optimizer_step()

    def _optimizer_step(self) -> bool:
        """Unscale, clip, step (unless non-finite), zero, advance the schedule; True if stepped."""
        self.scaler.unscale_(self.optimizer)  # clip true gradients, not scaled ones
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm > 0 else float("inf")
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        # The one host sync per optimizer step. A non-finite norm means an inf/NaN gradient,
        # which is exactly when GradScaler would skip, so one test serves every precision (fp16
        # too: stepping directly, not through GradScaler.step, which would sync again).
        stepped = bool(torch.isfinite(grad_norm))
        self._step_lr = self.optimizer.param_groups[0]["lr"]
        if stepped:
            self.optimizer.step()  # gradients are already unscaled
        self.scaler.update()  # fp16: lowers the scale after an overflow; a no-op otherwise
        self.optimizer.zero_grad(set_to_none=True)
        if stepped:
            self.optimizer_steps += 1
            if self.scheduler is not None:
                self.scheduler.step()
            if self.ema is not None:
                self.ema.update(self.model)
            self._window.grad_norm_sum += grad_norm.detach().float()
            self._window.steps += 1
        else:
            self.skipped_steps += 1
        self._count_nonfinite(stepped)
        return stepped

    def _count_nonfinite(self, finite: bool) -> None:
        self._nonfinite_in_row = 0 if finite else self._nonfinite_in_row + 1
        if self._nonfinite_in_row >= self.config.max_nonfinite_steps:
            raise NonFiniteLossError(
                f"{self._nonfinite_in_row} optimizer steps in a row had a non-finite loss or "
                f"gradient and were skipped (after step {self.optimizer_steps}, epoch "
                f"{self.epoch}; {self.skipped_steps} skipped in all). Lower optim.lr, set "
                "train.max_grad_norm, use train.precision=bf16, or check the data."
            )

    # ---- epochs -----------------------------------------------------------------------------
    def train_epoch(self, loader: Loader, epoch: int, hooks: TrainerHooks | None = None) -> None:
        """One pass over this rank's remaining batches of `epoch`."""
        self.epoch = epoch
        self.train_batches(loader, loader.batches_left(), total=len(loader), hooks=hooks)

    def train_batches(
        self, batches: Iterable[Batch], count: int, *, total: int = 0, hooks: TrainerHooks | None = None
    ) -> None:
        """Train on the `count` micro-batches that `batches` yields, `accum_steps` per step.

        Windows count from where this pass starts, which is an optimizer-step boundary
        (checkpoints are taken there), so a resumed pass forms the same windows as an
        uninterrupted one; the last window may be shorter and is stepped with its true length.
        """
        hooks = hooks or TrainerHooks()
        self.model.train()
        accum = self.config.accum_steps
        timer = self._timer = self._window.start_timer()
        total = max(total, count)
        first = total - count  # micro-batches of this epoch taken before this pass
        bar = progress_bar(self.epoch, total, first, self.config.progress and self.dist.rank == 0)
        seen, window = 0, []
        try:
            for batch in timer.iterate(batches):
                seen += 1
                window.append(batch)
                if len(window) < min(accum, count - (seen - len(window))):
                    continue
                stepped = self.train_step(window, first + seen - len(window))
                bar.update(len(window))
                window = []
                if (stepped and self.optimizer_steps % self.config.log_every == 0) or seen == count:
                    self._log(timer, bar, hooks)
                if hooks.on_step is not None:
                    hooks.on_step(self)
                if self._stop.agreed(hooks.stop_requested(), last=seen == count):
                    raise PreemptedError(f"stop requested at optimizer step {self.optimizer_steps}")
        finally:
            bar.close()  # also on preemption, OOM or a non-finite abort
        if seen != count or window:  # a window left open would leak into the next pass
            raise RuntimeError(f"the loader yielded {seen} batches where it announced {count}")

    def _log(self, timer: StepTimer, bar: tqdm, hooks: TrainerHooks) -> None:
        # Every rank logs at the same steps, and the extras may be collectives (the skipped-count
        # all-reduce): they run on every rank before anything that depends on this rank's data.
        extras: dict[str, Any] = {}
        for extra in hooks.record_extras:
            extras.update(extra())
        if self._window.samples == 0:  # every image since the last record was bad: no loss
            return  # the interval (time, images) carries on into the next record
        wall, wait = timer.lap()
        record = self._window.record(
            step=self.optimizer_steps,
            epoch=self.epoch,
            lr=self._step_lr,
            wall=wall,
            wait=wait,
            world_size=self.dist.world_size,
            skipped_steps=self.skipped_steps,
        )
        self.totals.add(record, wait)
        record.update(extras)
        self._emit(record)
        show_interval(bar, record, self.dist.rank)
        self._window = LogWindow.zeros(self.device)

    def evaluate(self, loader: Loader) -> dict[str, float]:
        """Top-1 and top-5 accuracy over this loader, summed across ranks."""
        return evaluate_model(self.model, loader, self.policy, self.device, self.dist)

    def fit(
        self,
        train_loader: Loader,
        val_loader: Loader | None,
        *,
        epochs: int,
        start_epoch: int = 0,
        hooks: TrainerHooks | None = None,
    ) -> dict[str, Any]:
        """Train `epochs` epochs (from `start_epoch`), validating after each; return the summary.

        The loader's epoch is set here, once per epoch; a restored mid-epoch position survives
        because the loader is already at that epoch.
        """
        hooks = hooks or TrainerHooks()
        val: dict[str, float] = {}
        for epoch in range(start_epoch, epochs):
            if train_loader.epoch != epoch:
                train_loader.set_epoch(epoch)
            self.train_epoch(train_loader, epoch, hooks)
            # The loader points at the next epoch's first batch before the epoch-end hook, so a
            # checkpoint taken there resumes at the next epoch, not at this one's end.
            train_loader.set_epoch(epoch + 1)
            if val_loader is not None:
                val = self._validate(val_loader, epoch)
            if hooks.on_epoch_end is not None:
                hooks.on_epoch_end(self, epoch)
        return {
            **self.totals.summary(),
            "images": self.totals.images,
            "train_s": self.totals.wall_s,
            "optimizer_steps": self.optimizer_steps,
            "skipped_steps": self.skipped_steps,
            **val,
        }

    def _validate(self, val_loader: Loader, epoch: int) -> dict[str, float]:
        val = self.evaluate(val_loader)
        if self.ema is not None:
            ema = evaluate_model(self.ema.module, val_loader, self.policy, self.device, self.dist)
            val |= {f"{key}_ema": ema[key] for key in ("val_top1", "val_top5", "val_loss")}
        # The best epoch so far (by val top-1): the run keeps its weights as best.pt.
        self.improved = val["val_top1"] > self.best_val_top1
        if self.improved:
            self.best_val_top1 = val["val_top1"]
        self._emit({"step": self.optimizer_steps, "epoch": epoch, **val})
        say_validation(epoch, val, self.dist.rank)
        return val

    def parts(self) -> dict[str, Stateful]:
        """This trainer's checkpoint parts by key; the epoch is the loader's to keep."""
        return {
            "model": ModelState(self.model),
            "optimizer": self.optimizer,
            "scaler": ScalerState(self.scaler),
            "scheduler": ScheduleState(self.scheduler),
            "counters": StateFns(self._counters, self._load_counters),
            "totals": self.totals,  # logged images and time, over all segments
            **({"ema": self.ema} if self.ema is not None else {}),
        }

    def state_dict(self) -> dict[str, Any]:
        """Every part's state under its key (`parts`)."""
        return save_parts(self.parts())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved (a checkpoint upgraded to the current format)."""
        load_parts(state, self.parts())

    def _counters(self) -> dict[str, Any]:
        return {
            "optimizer_steps": self.optimizer_steps,
            "skipped_steps": self.skipped_steps,
            "nonfinite_in_row": self._nonfinite_in_row,
            "best_val_top1": self.best_val_top1,
        }

    def _load_counters(self, counters: dict[str, Any]) -> None:
        self.optimizer_steps, self.skipped_steps = counters["optimizer_steps"], counters["skipped_steps"]
        self._nonfinite_in_row = counters["nonfinite_in_row"]
        self.best_val_top1 = float(counters["best_val_top1"])

    def interval_part(self) -> Stateful:
        """This rank's open log interval (sums, counts, seconds): a resume reopens it."""
        return StateFns(lambda: self._window.state_dict(self._timer), self._reopen_interval)

    def _reopen_interval(self, state: dict[str, Any]) -> None:  # the next pass goes on with it
        self._window = LogWindow.from_state(state, self.device)

    def _emit(self, record: dict[str, Any]) -> None:
        if self.dist.rank == 0:
            self.sinks.write(record)
