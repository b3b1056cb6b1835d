"""Every rank trains one listing: once the process group is up, before any step, each rank's
listing identity (sample count, digest of names and labels) is compared with rank 0's.

Nodes list on their own (a local copy each, or a store listed once a node); a store changed
between two nodes' listings, or two copies that differ, would deal one shard plan over two
datasets: samples trained twice or never, with no error. Why refuse rather than use rank 0's
listing: docs/DESIGN.md.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch.distributed as dist

from stallfree.data.readers.listing import Dataset
from stallfree.errors import StallfreeError
from stallfree.train.distributed import gather_objects, shutdown

# split -> (sample count, digest): what must be equal on every rank
Identity = dict[str, tuple[int, str]]


class ListingMismatchError(StallfreeError):
    """Ranks that listed different data for one run."""

    # Each node's first rank says it: the ranks of a node share its listing.
    same_on_every_rank = True


def identity(dataset: Dataset | None, data: dict[str, Any]) -> Identity:
    """Each split's count and digest; train's from `data` (`resume.data_record`, made once a
    run), the others hashed here. Relative to the root, so copies at other paths agree."""
    if dataset is None:
        return {}
    found: Identity = {}
    for split, listing in dataset.splits.items():
        if split == "train" and data:
            found[split] = (int(data["train_samples"]), str(data["train_digest"]))
        else:
            found[split] = (len(listing), listing.digest(with_prefix=False))
    return found


def node_name() -> str:
    """This host, and its node index where the launcher gives one (torchrun, Slurm)."""
    node = os.environ.get("GROUP_RANK", os.environ.get("SLURM_NODEID"))
    return socket.gethostname() + (f" node {node}" if node is not None else "")


def check_ranks_agree(dataset: Dataset | None, data: dict[str, Any], rank: int, world_size: int) -> None:
    """Raise ListingMismatchError on every rank when any rank's listing differs from rank 0's.

    Every rank gathers every identity, so all raise together and none is left waiting in a
    collective; each leaves the group first (a barrier, then destroy), as a rank that exits with
    gloo's group alive can abort in its teardown (SIGABRT, "terminate called without an active
    exception": https://github.com/pytorch/pytorch/issues/190489). A no-op outside a process group.
    """
    if world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return
    cached = dataset.cached_listing if dataset is not None else ""
    every: list[Any] = gather_objects((identity(dataset, data), node_name(), cached), world_size)
    differ = [r for r, (theirs, *_) in enumerate(every) if theirs != every[0][0]]
    if differ:
        other = rank if rank in differ else differ[0]  # this rank where it differs, else the first
        shutdown()
        raise ListingMismatchError(_mismatch(every[0], every[other], other, len(differ)))


# A rank's facts: (its identity, its node's name, its `Dataset.cached_listing`)
Facts = tuple[Identity, str, str]


def _mismatch(first: Facts, theirs: Facts, rank: int, differ: int) -> str:
    """One line: the first split that differs, rank 0's count against `rank`'s, and the fix:
    where one of the two resumed on its node's cached listing, that listing (the likely cause)."""
    (ours, our_node, our_cache), (other, other_node, other_cache) = first, theirs
    split = next(s for s in sorted(ours.keys() | other.keys()) if ours.get(s) != other.get(s))
    n0, n = ours.get(split, (0, ""))[0], other.get(split, (0, ""))[0]
    change = " (other files or labels)" if n == n0 else ""
    more = f"; {differ - 1} more rank(s) differ too" if differ > 1 else ""
    said = (
        f"the {split} split differs between ranks: rank 0 ({our_node}) lists {n0} samples, "
        f"rank {rank} ({other_node}) {n}{change}{more}"
    )
    if our_cache or other_cache:  # a node's stale cache, not a store that moved: say which
        who, node, cache = (0, our_node, our_cache) if our_cache else (rank, other_node, other_cache)
        return (
            f"{said}; rank {who} ({node}) resumed on {cache}, the likely cause: list again there and restart"
        )
    return (
        f"{said}; one run must train one listing: give every node the same data (add or remove "
        "no objects while the run starts), or list it once (`stallfree data check ROOT "
        "--write-list LIST`) and set data.file_list = LIST on a filesystem every node reads"
    )
