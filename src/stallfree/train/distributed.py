"""Process-group set-up for one process or `torchrun` (DDP), keyed by global rank."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from stallfree.errors import DeviceError, StallfreeError
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
        # gloo's worker frees the barrier's work (and the Python tensors of the collectives
        # before it) after the barrier returns, taking the GIL; DDP's reducer, the group's last
        # owner here, joins it holding the GIL: https://github.com/pytorch/pytorch/issues/56297.
        # A mitigation, not a mechanism: benchmarks/ddp_teardown.py and RESULTS.md say its figures.
        time.sleep(0.1)
        dist.destroy_process_group()


# The first rank to end on an error writes "RANK\nEXIT CODE\nLINE" here, in the group's store.
FIRST_TO_END_KEY = "stallfree/first_to_end"


class PeerEndedError(StallfreeError):
    """This rank failed after another rank had ended on an error (its collective lost its
    peer): one line naming that rank and its error, which that rank's own line says in full."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # the first rank's: a store outage's 75 asks for a requeue


def peer_ended_first(rank: int, exc: Exception) -> PeerEndedError | None:
    """After `exc` ended this rank's run in a process group: this rank is named the first to
    end, unless another rank was (then a PeerEndedError naming it, for an error of this rank's
    own that is no StallfreeError: gloo's "Connection closed by peer", NCCL's abort), so that
    peers whose collectives fail when this rank's connections close can say why in one line."""
    if not (dist.is_available() and dist.is_initialized()) or isinstance(exc, PeerEndedError):
        return None
    get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    first_line = (str(exc).splitlines() or [""])[0][:1000]
    line = first_line if isinstance(exc, StallfreeError) else f"{type(exc).__name__}: {first_line}"
    code = exc.exit_code if isinstance(exc, StallfreeError) else 1
    try:
        store = get_store() if get_store is not None else None
        if store is None:
            return None
        store.set_timeout(timedelta(seconds=5))  # a store whose host froze must not hold the exit
        first = store.compare_set(FIRST_TO_END_KEY, "", f"{rank}\n{code}\n{line}").decode(errors="replace")
    except Exception:  # noqa: BLE001 - under srun, rank 0 holds the store: it is gone
        if isinstance(exc, StallfreeError) or rank == 0:
            return None
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        return PeerEndedError(
            f"the process group's store at {where} stopped answering: rank 0 (or the launcher) "
            f"ended first, and its own line says why; this rank stopped with it ({type(exc).__name__})"
        )
    first_rank, first_code, first_error = (first.split("\n", 2) + ["", ""])[:3]
    if first_rank == str(rank) or isinstance(exc, StallfreeError):
        return None
    return PeerEndedError(
        f"rank {first_rank} ended first ({first_error}); this rank stopped with it ({type(exc).__name__})",
        int(first_code) if first_code.isdigit() else 1,
    )
