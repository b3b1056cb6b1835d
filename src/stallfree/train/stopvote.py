"""Ranks agreeing on a stop: a signal reaches one rank, or all at different steps, and every
rank must stop after the same optimizer step, or one would wait forever in a collective."""

from __future__ import annotations

from typing import Any

import torch

from stallfree.parallel import DistInfo
from stallfree.train.distributed import all_reduce_sum


class StopVote:
    """One vote per optimizer step, all-reduced in the background and read a step later.

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
