"""Automatic micro-batching (`train.micro_batch`): each loaded batch is cut into device-sized
chunks whose gradients add up to the batch's, so the global batch, the samples and the loader
positions never change (Composer's automatic micro-batching is the model).

One process backs off on an out-of-memory error and retries the same window; under DDP the
size is decided once before training by a probe on every rank (the smallest wins), so the
ranks never run different numbers of backward passes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from stallfree.train.interval import LogWindow

# torch.OutOfMemoryError is new in torch 2.5; the CUDA one is its alias there.
OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


@dataclass(slots=True)
class MicroBatcher:
    """How a batch of `n` is cut: chunks of at most `size` (0: the whole batch)."""

    size: int = 0
    auto: bool = False

    def split(self, n: int) -> list[tuple[int, int]]:
        """[start, stop) of each chunk of a batch of `n`."""
        size = self.size if 0 < self.size < n else n
        return [(start, min(start + size, n)) for start in range(0, n, size)]

    def can_back_off(self, world_size: int, n: int) -> bool:
        """Whether an out-of-memory error may be retried with smaller chunks."""
        return self.auto and world_size <= 1 and (self.size or n) > 1

    def oom_message(self, n: int, accum_steps: int) -> str:
        """What an out-of-memory error that cannot be retried says: the size and the fixes."""
        return (
            f"out of memory on a micro-batch of {self.size or n} images. Set "
            f'train.micro_batch = "auto", or lower train.batch_size and raise '
            f"train.accum_steps (now {accum_steps}) to keep the same "
            "global batch; --resume auto continues from the last checkpoint."
        )

    def back_off(self, n: int) -> None:
        """Halve the chunk size (after an out-of-memory error on a batch of `n`)."""
        self.size = max(1, (self.size or n) // 2)
        warnings.warn(
            f"out of memory: train.micro_batch = auto now cuts each batch of {n} into "
            f"chunks of {self.size} and retries the window",
            stacklevel=3,
        )


@dataclass(frozen=True, slots=True)
class WindowMark:
    """What a window's forwards change besides gradients: the logged sums and every buffer
    (BatchNorm's running stats and batch count). Buffers only, so the copy is small."""

    loss_sum: torch.Tensor
    samples: int
    buffers: list[torch.Tensor]

    @classmethod
    def take(cls, model: nn.Module, window: LogWindow) -> WindowMark:
        with torch.no_grad():
            buffers = [buffer.clone() for buffer in model.buffers()]
        return cls(window.loss_sum.clone(), window.samples, buffers)

    def restore(self, model: nn.Module, window: LogWindow) -> None:
        """Undo an aborted window's forwards, so its retry counts them once."""
        window.loss_sum, window.samples = self.loss_sum.clone(), self.samples
        with torch.no_grad():
            for buffer, saved in zip(model.buffers(), self.buffers):
                buffer.copy_(saved)


def probe_micro_batch(
    step: Callable[[int], None], batch_size: int, min_over_ranks: Callable[[int], int]
) -> int:
    """The largest power-of-two share of `batch_size` for which `step(size)` (one forward and
    backward) fits, agreed across ranks (the minimum)."""
    size = batch_size
    while size >= 1:
        try:
            step(size)
            break
        except OUT_OF_MEMORY:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            size //= 2
    return min_over_ranks(max(size, 0))
