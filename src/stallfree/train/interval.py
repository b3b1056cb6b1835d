"""A log interval: the device-side sums between two metrics records, the clock that times them,
and what a checkpoint keeps of one still open, so that a run resumed between two records
writes the records (and the totals summary.json adds up) of a run that never stopped."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class StepTimer:
    """Splits wall time into time blocked waiting for the next batch and everything else.

    `wall_s` and `wait_s` are seconds the first lap already had (before a resume)."""

    def __init__(self, wall_s: float = 0.0, wait_s: float = 0.0) -> None:
        self.wait_s = wait_s
        self._start = time.perf_counter() - wall_s

    def iterate(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield from `iterable`, adding the time each `next()` blocks to `wait_s`."""
        iterator = iter(iterable)
        while True:
            t0 = time.perf_counter()
            try:
                item = next(iterator)
            except StopIteration:
                self.wait_s += time.perf_counter() - t0
                return
            self.wait_s += time.perf_counter() - t0
            yield item

    def elapsed(self) -> tuple[float, float]:
        """(wall seconds, waiting seconds) of the lap so far."""
        return time.perf_counter() - self._start, self.wait_s

    def lap(self) -> tuple[float, float]:
        """(wall seconds, waiting seconds) since the last lap; starts a new lap."""
        now = time.perf_counter()
        wall, wait = now - self._start, self.wait_s
        self._start, self.wait_s = now, 0.0
        return wall, wait


@dataclass(slots=True)
class LogWindow:
    """Device-side sums between two log records: read (one host sync) only when logging.

    `wall_s` and `wait_s`: the seconds a resumed interval had before its checkpoint, which the
    next pass's timer starts from (`start_timer`)."""

    loss_sum: torch.Tensor
    grad_norm_sum: torch.Tensor
    samples: int = 0
    steps: int = 0
    wall_s: float = 0.0
    wait_s: float = 0.0

    @classmethod
    def zeros(cls, device: torch.device) -> LogWindow:
        zero = torch.zeros((), device=device)
        return cls(loss_sum=zero, grad_norm_sum=zero.clone())

    def start_timer(self) -> StepTimer:
        """A pass's timer, going on from the seconds a resumed interval had (once)."""
        timer = StepTimer(self.wall_s, self.wait_s)
        self.wall_s = self.wait_s = 0.0
        return timer

    def state_dict(self, timer: StepTimer) -> dict[str, Any]:
        """The open interval for a checkpoint (a host sync; saves are rare). The sums are
        float32 values, which a Python float holds exactly. An empty window has no seconds:
        between two passes the timer measures validation, not training."""
        wall, wait = timer.elapsed() if self.samples or self.steps else (0.0, 0.0)
        return {
            "loss_sum": self.loss_sum.item(),
            "grad_norm_sum": self.grad_norm_sum.item(),
            "samples": self.samples,
            "steps": self.steps,
            "wall_s": wall,
            "wait_s": wait,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], device: torch.device) -> LogWindow:
        """The window `state_dict` saved, on `device`."""
        return cls(
            loss_sum=torch.tensor(state["loss_sum"], device=device),
            grad_norm_sum=torch.tensor(state["grad_norm_sum"], device=device),
            samples=int(state["samples"]),
            steps=int(state["steps"]),
            wall_s=float(state["wall_s"]),
            wait_s=float(state["wait_s"]),
        )

    def record(
        self,
        *,
        step: int,
        epoch: int,
        lr: float,
        wall: float,
        wait: float,
        world_size: int,
        skipped_steps: int,
    ) -> dict[str, Any]:
        """The interval's metrics record; reading the sums is the interval's host sync."""
        images = self.samples * world_size
        return {
            "step": step,
            "epoch": epoch,
            "loss": (self.loss_sum / self.samples).item(),
            "lr": lr,
            "images_per_s": images / max(wall, 1e-9),
            "data_wait_frac": wait / max(wall, 1e-9),
            "grad_norm": (self.grad_norm_sum / max(1, self.steps)).item(),
            "skipped_steps": skipped_steps,
            # The interval's own totals, so a lost summary.json can be rebuilt exactly.
            "interval_s": wall,
            "images": images,
        }
