"""An exponential moving average of the weights, evaluated beside the raw ones."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside DDP (`.module`) and torch.compile (`._orig_mod`) wrappers."""
    while True:
        inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


class ModelEma:
    """`ema = d * ema + (1 - d) * weights` after every optimizer step that happened.

    The decay warms up as min(decay, (1 + step) / (10 + step)) (timm's ModelEmaV3 warmup), so
    the average is not dominated by the random initialisation early on. Buffers (BatchNorm
    statistics) are copied, not averaged. The update runs on the device with no host sync.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.module = copy.deepcopy(unwrap(model)).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)
        self.updates = 0

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Fold in `model`'s weights (call after an optimizer step)."""
        decay = self.current_decay()
        source = unwrap(model)
        ema_params: list[torch.Tensor] = list(self.module.parameters())
        torch._foreach_lerp_(ema_params, [p.detach() for p in source.parameters()], 1.0 - decay)
        for ema_buffer, buffer in zip(self.module.buffers(), source.buffers()):
            ema_buffer.copy_(buffer)
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        self.updates = int(state["updates"])
