"""Epoch order shared by every backend: one (seed, epoch) permutation, consumed in global batches.

Global batch i of an epoch is the slice [start + i*B*W, start + (i+1)*B*W) of the permutation,
and rank r's micro-batch is its r-th slice of B samples. So after any number of steps the
samples consumed are a *prefix* of the epoch's order, whatever the micro-batch split or world
size: a run can resume at a step boundary with another split, or another world size, and
continue on the next unseen sample. Both real backends read their samples from here, so for
the same recipe and world size they see the same samples in the same order, and `len()` agrees.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


def epoch_permutation(n: int, *, seed: int, epoch: int, shuffle: bool) -> tuple[np.ndarray, int]:
    """Return (order, seed_base): the global sample order and the base of the epoch's
    per-sample augmentation seeds (see `sample_seeds`).

    The order is int32 below 2**31 samples (4 bytes a sample, not 8: ImageNet-21k's 14.2M
    orders cost 57 MB); shuffling it in place draws the same permutation as
    `Generator.permutation(n)`. Seeds are derived per sample from the base rather than stored.
    """
    rng = np.random.default_rng([seed, epoch])
    order = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
    if shuffle:
        rng.shuffle(order)
    return order, int(rng.integers(0, 2**62))


def sample_seeds(base: int, ids: np.ndarray) -> np.ndarray:
    """Each sample's augmentation seed in an epoch: splitmix64 of (base + sample id).

    Indexed by sample id, not position, so a sample's augmentation does not depend on which
    rank, worker or resume position reads it.
    """
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as splitmix64 intends
        z = np.uint64(base) + np.asarray(ids, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(2)).astype(np.int64)  # 62 bits: a non-negative int64


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """How one rank cuts an epoch's global order into micro-batches.

    `drop_last` (training): only whole global batches; the last < B*W samples of the epoch are
    dropped, so every rank gets the same number of batches. Without it (validation), the tail is
    split into `world_size` near-equal contiguous chunks: every sample is read exactly once
    across ranks, and ranks may differ by one batch.
    """

    n: int
    batch_size: int
    rank: int = 0
    world_size: int = 1
    drop_last: bool = True

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    def _tail(self, start: int) -> tuple[int, int]:
        """(first, length) of this rank's share of the samples after the last whole global batch."""
        remaining = max(0, self.n - start)
        tail_start = start + remaining // self.global_batch * self.global_batch
        if self.drop_last:
            return tail_start, 0
        base, extra = divmod(self.n - tail_start, self.world_size)
        first = tail_start + self.rank * base + min(self.rank, extra)
        return first, base + (1 if self.rank < extra else 0)

    def num_batches(self, start: int = 0) -> int:
        """Batches this rank gets from global sample `start` to the end of the epoch."""
        whole = max(0, self.n - start) // self.global_batch
        return whole + (1 if self._tail(start)[1] else 0)

    def batches(self, order: np.ndarray, start: int = 0) -> Iterator[np.ndarray]:
        """This rank's micro-batches (arrays of sample ids) from global sample `start` on."""
        whole = max(0, self.n - start) // self.global_batch
        for i in range(whole):
            first = start + i * self.global_batch + self.rank * self.batch_size
            yield order[first : first + self.batch_size]
        first, length = self._tail(start)
        if length:
            yield order[first : first + length]

    def position_after(self, start: int, batches: int) -> int:
        """The global sample position once every rank has taken `batches` more micro-batches."""
        return min(self.n, start + batches * self.global_batch)
