"""augment.auto_augment: RandAugment and TrivialAugmentWide alike on both loaders.

Each operation of the torch backend's suites (stallfree.data.transforms.policies) is checked against DALI's
own (nvidia.dali.auto_aug) at fixed magnitudes and signs; DALI's graph applies the operations
both loaders are handed (`draw_ops`); both loaders run them end to end.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import build_loader, small_recipe
from test_autoaug import CPU


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["torch", pytest.param("dali", marks=pytest.mark.dali)])
def test_both_loaders_train_with_a_policy(image_root: Path, backend: str) -> None:
    """A train epoch with RandAugment: the batch contract holds, the pixels differ from the
    epoch without it, and two loaders of one seed agree (resume depends on it)."""

    def first_batch(policy: str) -> torch.Tensor:
        recipe = small_recipe(image_root, augment={"auto_augment": policy}, loader={"backend": backend})
        loader = build_loader(recipe, "train", device=CPU)
        loader.set_epoch(1)
        images = next(iter(loader)).images
        loader.close()
        return images

    plain, augmented = first_batch("none"), first_batch("randaugment")
    assert augmented.shape == plain.shape and augmented.dtype == torch.float32
    assert torch.isfinite(augmented).all() and not torch.equal(plain, augmented)
    assert torch.equal(augmented, first_batch("randaugment"))
