"""Process-group set-up for one process or `torchrun` (DDP), keyed by global rank."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from stallfree.errors import DeviceError
from stallfree.parallel import DistInfo
from stallfree.train.slurm import slurm_rendezvous


def local_cuda_index(info: DistInfo, visible: int) -> int:
    """The CUDA device of this rank among the `visible` ones.

    torchrun with 8 GPUs per node: LOCAL_RANK. Slurm's `--gpus-per-task=1` shows each task one
    GPU (index 0) while LOCAL_RANK still counts the node's tasks: a rank that sees exactly one
    GPU uses it.
    """
    if visible < 1:
        raise DeviceError("train.device = cuda but no CUDA device is visible; use --device cpu")
    if info.local_rank < visible:
        return info.local_rank
    if visible == 1:
        return 0
    raise DeviceError(
        f"LOCAL_RANK {info.local_rank} has no CUDA device: only {visible} visible "
        f"(CUDA_VISIBLE_DEVICES); give each rank its own GPU or launch fewer processes per node"
    )


def resolve_device(name: str, info: DistInfo) -> torch.device:
    """`auto` is this rank's CUDA device when there is one, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                "the device is cuda (--device or train.device) but CUDA is not available here; "
                "use --device cpu (or auto)"
            )
        return torch.device("cuda", local_cuda_index(info, torch.cuda.device_count()))
    return torch.device(name)


def init_distributed(info: DistInfo, device: torch.device) -> None:
    """Join the process group when launched by torchrun or as an srun step of several tasks."""
    if info.world_size <= 1 or dist.is_initialized():
        return
    if info.slurm_step:  # no torchrun: the rendezvous comes from Slurm's variables
        os.environ.update(slurm_rendezvous())
        if "OMP_NUM_THREADS" not in os.environ:
            # As torchrun does (it sets 1): a rank's intra-op threads are its own CPUs, not
            # every core of a node shared with the other ranks.
            torch.set_num_threads(int(os.environ.get("SLURM_CPUS_PER_TASK", "1")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # device_id binds the group to this GPU, so NCCL connects now rather than at the first
        # collective, and a misconfigured node fails at start-up.
        dist.init_process_group("nccl", device_id=device, rank=info.rank, world_size=info.world_size)
    else:
        dist.init_process_group("gloo", rank=info.rank, world_size=info.world_size)


def wrap_model(model: nn.Module, device: torch.device, info: DistInfo) -> nn.Module:
    """DDP when world_size > 1; the bare model otherwise."""
    if info.world_size <= 1:
        return model
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def all_reduce_sum(tensor: torch.Tensor, async_op: bool = False) -> Any:
    """Sum over ranks in place (a no-op in a single process); returns the tensor, or with
    `async_op` the work handle to `wait()` on before reading it."""
    work = None
    if dist.is_available() and dist.is_initialized():
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=async_op)
    return (work or _Done()) if async_op else tensor


class _Done:
    """The handle of an all-reduce that had nothing to wait for (a single process)."""

    def wait(self) -> bool:
        return True


def broadcast_buffers(model: nn.Module) -> None:
    """Rank 0's buffers (BatchNorm running statistics) to every rank."""
    if dist.is_available() and dist.is_initialized():
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


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
