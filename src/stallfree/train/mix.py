"""Mixup and CutMix on the device, after either loader, with host-side seeded draws.

Every random choice (apply or not, mixup or cutmix, lambda, the partner permutation, the box)
comes from a generator seeded by (seed, epoch, micro-batch index in the epoch, rank), so a
resumed run mixes exactly the batches an uninterrupted one would, and the device never syncs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class Mixed:
    """Images mixed with a permutation of the batch; the loss is lam * CE(y) + (1-lam) * CE(y2)."""

    images: torch.Tensor
    labels: torch.Tensor
    partner_labels: torch.Tensor
    lam: float


class Mixer:
    """timm-style batch mixing: with probability `prob`, mixup or cutmix (chosen 50/50 when
    both alphas are set), lambda ~ Beta(alpha, alpha)."""

    def __init__(self, *, mixup_alpha: float, cutmix_alpha: float, prob: float, seed: int, rank: int) -> None:
        self.mixup_alpha, self.cutmix_alpha, self.prob = mixup_alpha, cutmix_alpha, prob
        self.seed, self.rank = seed, rank

    @property
    def enabled(self) -> bool:
        return self.prob > 0 and (self.mixup_alpha > 0 or self.cutmix_alpha > 0)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, *, epoch: int, index: int) -> Mixed | None:
        """Mix micro-batch `index` of `epoch`, or None when this batch is left as it is."""
        rng = np.random.default_rng([self.seed, epoch, index, self.rank, 0x3D1])
        if not self.enabled or rng.random() >= self.prob:
            return None
        use_cutmix = self.cutmix_alpha > 0 and (self.mixup_alpha <= 0 or rng.random() < 0.5)
        alpha = self.cutmix_alpha if use_cutmix else self.mixup_alpha
        lam = float(rng.beta(alpha, alpha))
        perm = torch.from_numpy(rng.permutation(images.shape[0])).to(images.device)
        if use_cutmix:
            images, lam = _cutmix(images, perm, lam, rng)
        else:
            images = images.mul(lam).add_(images[perm], alpha=1 - lam)
        return Mixed(images, labels, labels[perm], lam)


def _cutmix(
    images: torch.Tensor, perm: torch.Tensor, lam: float, rng: np.random.Generator
) -> tuple[torch.Tensor, float]:
    """Paste a box of the partner image; lam becomes the exact share of the kept area."""
    height, width = images.shape[-2:]
    cut = math.sqrt(1 - lam)
    box_h, box_w = int(height * cut), int(width * cut)
    cy, cx = int(rng.integers(height)), int(rng.integers(width))
    y0, y1 = max(cy - box_h // 2, 0), min(cy + box_h // 2, height)
    x0, x1 = max(cx - box_w // 2, 0), min(cx + box_w // 2, width)
    mixed = images.clone()
    mixed[..., y0:y1, x0:x1] = images[perm][..., y0:y1, x0:x1]
    return mixed, 1 - (y1 - y0) * (x1 - x0) / (height * width)
