"""An object store during a run: its retries in the metrics, and an outage that outlasts the
budget (STALLFREE_S3_OUTAGE_S) stopping the run as a preemption does.

A store that stays down is "try again later", not a broken run: the run saves a checkpoint at
its last optimizer step, writes preempted.json, says the object and the reason in one line and
exits with PREEMPTED_EXIT_CODE (75), so a requeue loop, or `--resume auto` by hand once the
store is back, continues exactly where it stopped.

Under DDP (world size > 1) the rank whose read failed saves nothing: a save gathers every
rank's loader and RNG state, and another rank may at that moment be inside the step's gradient
all-reduce. That is common, not rare: the workers of each rank hold their own few batches read
ahead, so when the store goes, one rank still has its next batch and enters the step's backward
while another waits in its read. A gather sent then would be matched against that all-reduce.
So with 2 ranks: rank A's read gives up after the budget; A says its line (the object, the
reason, exit code 75) and exits without the closing barrier. Rank B is either waiting in its
own read (it gives up in turn and says its own line) or blocked in the all-reduce: with gloo
the all-reduce fails when A's connections close; torchrun, seeing A exit, stops B anyway
(SIGTERM, then SIGKILL after its grace period: a rank blocked in NCCL never returns to Python
to see a SIGTERM); without torchrun, NCCL's watchdog ends B after the process group's timeout.
No rank waits forever, no checkpoint is half-written, and `--resume auto` continues exactly
from the last periodic or epoch-end checkpoint (train.ckpt_every_steps bounds the steps
retrained). Saving at the last step under DDP would need the ranks to agree, before each
step's backward, that every one has its batch: a collective per step, not paid for this.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from stallfree.data import storage
from stallfree.data.loader import Loader
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


class StepMark:
    """Where the train loader stood after the last optimizer step: an outage met between the
    fetches of an accumulation window leaves the loader past micro-batches never trained on
    (the trainer collects a window before its forwards, so nothing else moved).

    With `snapshot` (a run from a store, where outages happen), the loader's whole state is
    kept at every step: DALI's random state has moved past the batches its pipeline had read
    ahead when the store went, and a resume from that state differed from an uninterrupted run
    (a new user's, from the step after the stop on). Its checkpoint as of the step is ~450
    bytes and 0.02 ms to take (AMD EPYC), so every step takes one."""

    def __init__(self, loader: Loader, snapshot: bool = False) -> None:
        self.loader = loader
        self.epoch, self.position = loader.epoch, loader.position  # a resume's point, or 0
        self.snapshot = snapshot
        # The state a SIGTERM at this point would save: a restored one's, before any step.
        self.state: dict[str, Any] | None = loader.state_dict() if snapshot else None

    def step(self) -> None:
        """After each optimizer step (the run's on_step hook): two counters read, and with
        `snapshot` the loader's state."""
        self.epoch, self.position = self.loader.epoch, self.loader.position
        if self.snapshot:
            self.state = self.loader.state_dict()

    def loader_state(self, stop: PreemptedError | None = None) -> dict[str, Any]:
        """The loader's state to save on `stop`; after an outage, as of the last step: the
        snapshot where one was kept, else positions put back (they are global samples, so the
        window's micro-batches, every rank's, are given back, and a new epoch with no step yet
        starts at 0) and DALI's random state, which is past them, dropped: that resume starts
        a fresh stream, in the same sample order."""
        if isinstance(stop, StoreOutage) and self.state is not None:
            if self.loader.epoch == self.state["epoch"]:
                return dict(self.state)
            # The run had moved on (validating, or the next epoch's first fetch): that epoch's
            # start, with the random state as the last one ended (its end would validate again).
            return {**self.state, "epoch": self.loader.epoch, "position": 0}
        state = self.loader.state_dict()
        if isinstance(stop, StoreOutage):
            position = self.position if state["epoch"] == self.epoch else 0
            if state["position"] != position:
                state["position"] = position
                state.pop("dali", None)
        return state


def can_save(stop: PreemptedError, world_size: int) -> bool:
    """Whether the run may save on this stop: not after one rank's outage under DDP (above)."""
    return not isinstance(stop, StoreOutage) or world_size == 1


def unsaved(stop: PreemptedError) -> storage.StoreUnavailableError:
    """The error a rank's outage under DDP ends the run with (exit code 75, said by that rank)."""
    return storage.StoreUnavailableError(
        f"{stop}; no checkpoint at this step under DDP (the other ranks may be inside a "
        "collective): --resume auto continues from the last saved one once the store is back"
    )


def retries_record(root: str, device: torch.device) -> Callable[[], dict[str, float]] | None:
    """For a run from an s3:// root: a log record's `store_retries`, the requests retried since
    this run (segment) started, by every rank and its DataLoader workers (storage.retries), summed
    over ranks. An all-reduce: every rank logs at the same steps. None for a local root."""
    if storage.open(root).is_local:
        return None
    before = storage.retries()  # a process that ran something else first (train() in a notebook)

    def record() -> dict[str, float]:
        count = torch.tensor([float(storage.retries() - before)], device=device)
        return {"store_retries": int(all_reduce_sum(count).item())}

    return record
