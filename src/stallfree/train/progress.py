"""What a training pass says as it goes: the progress bar, one line per log interval when
there is no bar (a batch job's log), and one per validation."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm

from stallfree.log import LOGGER
from stallfree.metrics import interval_line


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
