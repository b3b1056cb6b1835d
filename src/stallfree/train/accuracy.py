"""Top-1, top-5 and the loss over a loader, counted on every rank and summed: the one
evaluation that the trainer (after each epoch) and `stallfree eval` share.

It stays apart from train/evaluate.py (the eval command): the trainer needs it, and the eval
command needs the trainer's builders, so one module for both would import itself in a loop."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from stallfree.data.loader import Loader
from stallfree.parallel import DistInfo
from stallfree.train.distributed import all_reduce_sum, broadcast_buffers
from stallfree.train.precision import PrecisionPolicy


@torch.no_grad()
def evaluate_model(
    model: nn.Module, loader: Loader, policy: PrecisionPolicy, device: torch.device, dist: DistInfo
) -> dict[str, float]:
    """Top-1 and top-5 accuracy and the mean cross-entropy (no label smoothing) over `loader`,
    summed across ranks, and the samples counted.

    Ranks may hold different numbers of val batches (every sample is read exactly once), so
    the model runs unwrapped: DDP's forward must not wait for ranks that have finished.
    """
    model = model.module if isinstance(model, DistributedDataParallel) else model
    if dist.world_size > 1:
        broadcast_buffers(model)  # BatchNorm statistics as checkpointed (rank 0's)
    model.eval()
    counts = torch.zeros(4, device=device)  # top1, top5, samples, loss sum
    for batch in loader:
        with policy.autocast():
            logits = model(batch.images)
        k = min(5, logits.shape[1])
        top = logits.float().topk(k, dim=1).indices
        hits = top.eq(batch.labels[:, None])
        counts[0] += hits[:, 0].sum()
        counts[1] += hits.any(dim=1).sum()
        counts[2] += batch.labels.numel()
        counts[3] += nn.functional.cross_entropy(logits.float(), batch.labels, reduction="sum")
    top1, top5, total, loss = all_reduce_sum(counts).tolist()
    return {
        "val_top1": top1 / max(total, 1),
        "val_top5": top5 / max(total, 1),
        "val_loss": loss / total if total else float("nan"),
        "val_samples": int(total),
    }
