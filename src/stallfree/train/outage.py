"""An object store during a run: its retries in the metrics, and an outage that outlasts the
budget (STALLFREE_STORE_OUTAGE_S) stopping the run as a preemption does: a checkpoint at the last
optimizer step, preempted.json, one line naming the object and exit code 75, so a requeue (or
`--resume auto` once the store is back) continues exactly where it stopped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from stallfree.data import storage
from stallfree.train.distributed import all_reduce_sum
from stallfree.train.trainer import PreemptedError


class StoreOutage(PreemptedError):
    """The store stayed down past its budget: the run stops, with a checkpoint at its last step."""

    signal = "the object store stayed down"


@contextlib.contextmanager
def outage_as_stop() -> Iterator[None]:
    """The store's error, wherever the run meets it (a step's batch, validation), as a stop."""
    try:
        yield
    except storage.StoreUnavailableError as exc:
        raise StoreOutage(str(exc)) from None


def can_save(stop: PreemptedError, world_size: int) -> bool:
    """Whether the run may save on this stop: not after one rank's outage under DDP."""
    # A save gathers every rank's state, and another rank may then be inside the step's
    # gradient all-reduce (its workers still held a batch): the gather would be matched against
    # it. So the failing rank says its line and exits; the others fail in their own read, in the
    # collective (gloo) or are stopped by torchrun / NCCL's watchdog. `--resume auto` continues
    # from the last periodic or epoch-end checkpoint; saving at the last step would cost a
    # collective per step (every rank agreeing it has its batch).
    return not isinstance(stop, StoreOutage) or world_size == 1


def outage_error_without_save(stop: PreemptedError) -> storage.StoreUnavailableError:
    """The error a rank's outage under DDP ends the run with (exit code 75, said by that rank)."""
    return storage.StoreUnavailableError(
        f"{stop}; no checkpoint at this step under DDP (the other ranks may be inside a "
        "collective): --resume auto continues from the last saved one once the store is back"
    )


def retries_record(root: storage.Location, device: torch.device) -> Callable[[], dict[str, float]] | None:
    """For a run from a store that retries requests: a log record's `store_retries`, the
    requests retried since this run (segment) started, by every rank and its DataLoader workers,
    summed over ranks. An all-reduce: every rank logs at the same steps. None for a local root."""
    store = root.store
    before = store.retries()  # a process that ran something else first (train() in a notebook)
    if before is None:
        return None

    def record() -> dict[str, float]:
        now = store.retries() or 0
        count = torch.tensor([float(now - before)], device=device)
        return {"store_retries": int(all_reduce_sum(count).item())}

    return record
