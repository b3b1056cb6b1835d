"""Process identity in a (possibly single-process) job: rank, world size, local rank.

Ground floor: both data/ and train/ read it, and it imports nothing of theirs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DistInfo:
    """Where this process sits in a (possibly single-process) job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @classmethod
    def from_env(cls) -> DistInfo:
        """What torchrun put in the environment; a single process without it."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size <= 1:
            return cls()
        return cls(rank=int(os.environ["RANK"]), world_size=world_size,
                   local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                   local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_workers(requested: int, local_world_size: int) -> int:
    """`requested` when >= 0; else this rank's share of the cores, shared among the node's ranks.

    One rule for DataLoader workers and DALI threads, so the head-to-head gives both backends
    the same CPU budget.
    """
    if requested >= 0:
        return requested
    return max(1, min(16, cpu_cores() // max(1, local_world_size)))
