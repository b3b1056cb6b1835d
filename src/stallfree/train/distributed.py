"""Process-group set-up for one process or `torchrun` (DDP), keyed by global rank."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from stallfree.data.loader import DistInfo


def init_distributed(device_type: str) -> DistInfo:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1); else a single process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistInfo()
    info = DistInfo(
        rank=int(os.environ["RANK"]), world_size=world_size,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    )
    if not dist.is_initialized():
        if device_type == "cuda":
            torch.cuda.set_device(info.local_rank)
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return info


def resolve_device(name: str, dist_info: DistInfo) -> torch.device:
    """`auto` is the local CUDA device when there is one, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("train.device = cuda but CUDA is not available; use --device cpu")
        return torch.device("cuda", dist_info.local_rank)
    return torch.device(name)


def wrap_model(model: nn.Module, device: torch.device, dist_info: DistInfo) -> nn.Module:
    """DDP when world_size > 1; the bare model otherwise."""
    if dist_info.world_size <= 1:
        return model
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks in place (a no-op in a single process)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def gather_objects(local: object, world_size: int) -> list[object]:
    """Every rank's `local`, in rank order (a one-element list in a single process)."""
    if world_size <= 1:
        return [local]
    gathered: list[object] = [None] * world_size
    dist.all_gather_object(gathered, local)
    return gathered


def shutdown() -> None:
    """Leave the process group, if joined: a barrier, then destroy.

    Call it only where every rank arrives (a finished or an agreed-preempted run). The barrier
    keeps a fast rank from tearing down its gloo/NCCL state while a slow one (rank 0 writing a
    checkpoint) still talks to it; after a one-rank failure, destroying could deadlock instead.
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
