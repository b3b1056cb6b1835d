"""Stop signals, from the process's start to the ranks' agreement on a stop: Slurm's SIGUSR1
kept from before the run's handler is in place (and forgotten after), SIGTERM/SIGINT turned
into a flag the trainer reads after a step, and every rank stopping after the same step.
Torch-free at import: the CLI installs the first handler before torch loads."""

from __future__ import annotations

import signal
from types import FrameType
from typing import TYPE_CHECKING, Any

from stallfree.parallel import DistInfo

if TYPE_CHECKING:
    import torch

_early: list[str] = []  # SIGUSR1s that came before the run's own handler was in place


def _remember(signum: int, frame: FrameType | None) -> None:
    _early.append(signal.Signals(signum).name)


def remember_early_stops() -> None:
    """Keep a SIGUSR1 from now on (its default action kills the process, e.g. while torch
    imports) until a run takes it; one from an earlier run in this process is forgotten."""
    _early.clear()
    signal.signal(signal.SIGUSR1, _remember)


def start_up_stop() -> StopSignal:
    """What `stallfree train` holds from its start: a SIGUSR1 during start-up (imports,
    listing, checks), or before it, is kept and honoured after the first step. SIGTERM and
    Ctrl-C then stop at once: there is nothing new to save yet."""
    stop = StopSignal((signal.SIGUSR1,))
    stop.requested = _early[0] if _early else None
    _early.clear()  # taken: a later run in this process starts without it
    return stop


class StopSignal:
    """Turns SIGTERM, SIGUSR1 and a first SIGINT into a flag the trainer checks after a step.

    A second SIGINT stops at once (KeyboardInterrupt), for a user who does not want to wait.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, signals: tuple[int, ...] = SIGNALS) -> None:
        self.requested: str | None = None  # the name of the first stop signal
        self.signals = signals
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.requested == "SIGINT":
            raise KeyboardInterrupt
        self.requested = self.requested or signal.Signals(signum).name

    def __enter__(self) -> StopSignal:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
            outer = getattr(self._previous[sig], "__self__", None)
            if isinstance(outer, StopSignal) and outer.requested and not self.requested:
                self.requested = outer.requested  # came during start-up: honoured now
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class StopVote:
    """Ranks agreeing on a stop: one vote per optimizer step, all-reduced in the background
    and read a step later, so that every rank stops after the same step (or one would wait
    forever in a collective).

    Under DDP each step starts an async all-reduce of this rank's flag and reads the one
    started a step earlier: it finished while this step ran, so reading it costs nothing,
    and a signal is honoured one or two steps after it came. The pass's last step settles
    the vote at once, so no collective is left open across validation or the epoch end.
    """

    def __init__(self, dist: DistInfo, device: torch.device) -> None:
        self.dist, self.device = dist, device
        self._pending: tuple[Any, torch.Tensor] | None = None  # the last step's vote in flight

    def agreed(self, flag: bool, last: bool) -> bool:
        """True when any rank was asked to stop; every rank gets the same answer."""
        if self.dist.world_size <= 1:
            return flag
        import torch  # here, not at the top: the CLI imports this module before torch loads

        from stallfree.train.distributed import all_reduce_sum

        agreed = False
        if self._pending is not None:
            work, votes = self._pending
            work.wait()
            agreed = bool(votes.item() > 0)  # after this step's own host sync: already there
            self._pending = None
        if agreed:  # every rank read the same vote: all stop here, no collective left open
            return True
        votes = torch.tensor([float(flag)], device=self.device)
        if last:
            return bool(all_reduce_sum(votes).item() > 0)
        self._pending = (all_reduce_sum(votes, async_op=True), votes)
        return False
