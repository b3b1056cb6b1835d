"""What a training pass says as it goes: the progress bar, one line per log interval when
there is no bar (a batch job's log), and one per validation."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from stallfree.log import LOGGER
from stallfree.metrics import interval_line

if TYPE_CHECKING:  # the trainer imports this module
    from stallfree.train.trainer import Trainer


def progress_bar(epoch: int, total: int, initial: int, enabled: bool) -> tqdm:
    """The pass's bar over micro-batches (off: `enabled` false, as on every rank but 0)."""
    return tqdm(
        total=total,
        initial=initial,
        desc=f"epoch {epoch}",
        unit="batch",
        leave=False,
        dynamic_ncols=True,
        disable=not enabled,
    )


def show_interval(bar: tqdm, record: dict[str, Any], rank: int) -> None:
    """A log interval's figures on the bar, or as one plain line where there is no bar."""
    skipped = {"skipped": record["skipped_samples"]} if "skipped_samples" in record else {}
    bar.set_postfix(
        loss=f"{record['loss']:.3f}",
        img_s=f"{record['images_per_s']:.0f}",
        wait=f"{100 * record['data_wait_frac']:.0f}%",
        **skipped,
    )
    if bar.disable and rank == 0:
        LOGGER.info(interval_line(record))


def say_validation(epoch: int, val: dict[str, float], rank: int) -> None:
    """One line per validation, with or without a progress bar: a batch log needs it."""
    if rank == 0:
        LOGGER.info(
            f"epoch {epoch}: val top-1 {val['val_top1']:.4f} "
            f"top-5 {val['val_top5']:.4f} loss {val['val_loss']:.4f} "
            f"({int(val['val_samples'])} images)"
        )


def time_to_go(seconds: float) -> str:
    """`seconds` in the unit that reads: seconds under a minute, minutes under an hour, hours."""
    if seconds < 1:
        return "less than a second"
    if seconds < 60:
        return f"about {seconds:.0f} s"
    if seconds < 3600:
        return f"about {seconds / 60:.1f} min"
    return f"about {seconds / 3600:.1f} h"


class TimeToGo:
    """Prints once, after the first steps, how long the rest of the run should take."""

    AFTER_STEPS = 10

    def __init__(self, trainer: Trainer, total_steps: int) -> None:
        self.trainer, self.total_steps = trainer, total_steps
        self.first_step: int | None = None
        self.started = 0.0
        self.done = trainer.dist.rank != 0

    def step(self) -> None:
        if self.done:
            return
        if self.first_step is None:
            # The clock starts after the first step: worker and pipeline start-up (seconds
            # for a loader's graph with a policy) is paid once, not by every step to go.
            self.first_step, self.started = self.trainer.optimizer_steps, time.perf_counter()
            return
        steps = self.trainer.optimizer_steps - self.first_step
        if steps < min(self.AFTER_STEPS, self.total_steps - self.first_step):
            return
        self.done = True
        per_step = (time.perf_counter() - self.started) / max(1, steps)
        left = (self.total_steps - self.trainer.optimizer_steps) * per_step
        LOGGER.info(
            f"{time_to_go(left)} to go ({self.total_steps} steps in "
            f"all at {per_step:.2f} s each; validation not included)"
        )
