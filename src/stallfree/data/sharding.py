"""Epoch order shared by every backend: a (seed, epoch) permutation cut into per-rank shards.

Both real backends read their samples from here, so that for the same recipe and world size
they see the same samples in the same order, and `len()` agrees.
"""

from __future__ import annotations

import numpy as np


def epoch_permutation(n: int, *, seed: int, epoch: int, shuffle: bool) -> tuple[np.ndarray, np.ndarray]:
    """Return (order, aug_seeds): the global sample order and one augmentation seed per sample.

    Seeds are indexed by sample id, not position, so a sample's augmentation in an epoch does not
    depend on which rank, worker or resume position reads it.
    """
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(n) if shuffle else np.arange(n)
    aug_seeds = rng.integers(0, 2**62, size=n, dtype=np.int64)
    return order, aug_seeds


def shard(order: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Contiguous shard `rank` of `world_size`, equal sizes, remainder dropped.

    Contiguous, because DALI's `readers.file` shards that way: shard i reads
    [i*N/W, (i+1)*N/W). Handing it a list of exactly W*(N//W) files makes its shards ours.
    """
    per_rank = len(order) // world_size
    return order[rank * per_rank:(rank + 1) * per_rank]


def num_batches(samples_per_rank: int, batch_size: int, drop_last: bool) -> int:
    """Batches one rank gets per epoch."""
    if drop_last:
        return samples_per_rank // batch_size
    return -(-samples_per_rank // batch_size)


class EpochCursor:
    """Epoch and position inside it: what a loader needs to resume on the next unseen batch."""

    def __init__(self) -> None:
        self.epoch = 0
        self.position = 0  # batches already handed out in `epoch`

    def set_epoch(self, epoch: int) -> None:
        # Keep a restored mid-epoch position when the trainer re-announces that same epoch.
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
