"""A small CNN that learns the demo data in a couple of CPU minutes."""

from __future__ import annotations

import torch
from torch import nn


def _block(in_ch: int, out_ch: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_ch, out_ch, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_ch),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
    )


class SmallCNN(nn.Module):
    """Four conv-BN-ReLU-pool blocks and a linear head; any input size >= 16 px."""

    def __init__(
        self, num_classes: int = 10, width: int = 32, zero_init_residual: bool = False, drop_rate: float = 0.0
    ) -> None:
        super().__init__()
        self.features = nn.Sequential(
            _block(3, width),
            _block(width, width * 2),
            _block(width * 2, width * 4),
            _block(width * 4, width * 4),
        )
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(drop_rate), nn.Linear(width * 4, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))
