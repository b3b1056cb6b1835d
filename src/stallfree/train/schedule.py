"""Learning-rate schedule counted in optimizer steps: linear warmup, then cosine decay."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def warmup_cosine(
    optimizer: torch.optim.Optimizer, *, total_steps: int, warmup_steps: int = 0, min_lr_frac: float = 0.0
) -> LambdaLR:
    """Multiplier ramps 1/w .. 1 over `warmup_steps`, then follows a cosine to `min_lr_frac`.

    The trainer calls `step()` only after an optimizer step that happened, so a GradScaler
    skip or a non-finite skip does not advance the schedule.
    """
    total_steps = max(1, total_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


def build_optimizer(
    model: torch.nn.Module,
    name: str,
    *,
    lr: float,
    momentum: float,
    weight_decay: float,
    nesterov: bool = False,
    exclude_norm_bias: bool = True,
) -> torch.optim.Optimizer:
    """SGD (optionally Nesterov) or AdamW.

    With `exclude_norm_bias`, biases and normalisation parameters (every 1-D tensor) get no
    weight decay; otherwise every parameter does.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    excluded = [p for p in params if exclude_norm_bias and p.ndim <= 1]
    groups = [
        {
            "params": [p for p in params if not (exclude_norm_bias and p.ndim <= 1)],
            "weight_decay": weight_decay,
        }
    ]
    if excluded:
        groups.append({"params": excluded, "weight_decay": 0.0})
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    raise ValueError(f"optim.name = {name!r}; choose one of sgd, adamw")
