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
        """What torchrun, or else an `srun` job step, put in the environment; else one process.

        Under srun (one task per GPU, no torchrun) Slurm's own variables give the ranks. Only a
        job step counts: the batch script's shell also has SLURM_NTASKS, but no step's task
        count, and must stay a single process.
        """
        env = os.environ
        if "WORLD_SIZE" in env:
            world_size = int(env["WORLD_SIZE"])
            if world_size <= 1:
                return cls()
            return cls(
                rank=int(env["RANK"]),
                world_size=world_size,
                local_rank=int(env.get("LOCAL_RANK", "0")),
                local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
            )
        tasks = int(env.get("SLURM_STEP_NUM_TASKS", "1"))
        if tasks <= 1 or "SLURM_PROCID" not in env:
            return cls()
        per_node = _expand_counts(env.get("SLURM_STEP_TASKS_PER_NODE", str(tasks)))
        node = int(env.get("SLURM_NODEID", "0"))
        return cls(
            rank=int(env["SLURM_PROCID"]),
            world_size=tasks,
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            local_world_size=per_node[node] if node < len(per_node) else per_node[-1],
        )

    @property
    def slurm_step(self) -> bool:
        """Launched as a task of an srun step (not by torchrun): the rendezvous is Slurm's."""
        return self.world_size > 1 and "WORLD_SIZE" not in os.environ


def _expand_counts(text: str) -> list[int]:
    """Slurm's tasks per node, "2(x3),1" -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in text.split(","):
        count, _, repeat = part.partition("(x")
        counts += [int(count)] * int(repeat.rstrip(")") or 1)
    return counts


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_workers(requested: int | str, local_world_size: int) -> int:
    """`requested` when >= 0; else (-1, or an "auto" that was not measured) this rank's share
    of the cores, shared among the node's ranks.

    One rule for DataLoader workers and DALI threads, so the head-to-head gives both backends
    the same CPU budget.
    """
    if isinstance(requested, int) and requested >= 0:
        return requested
    return max(1, min(16, cpu_cores() // max(1, local_world_size)))
