"""augment.random_erasing: the same rectangles, in distribution, on both loaders."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import build_loader, small_recipe

from stallfree.recipe import RecipeError, apply_overrides, validate

CPU = torch.device("cpu")
# A fill colour of whole levels (102, 51, 153), so an erased pixel is exactly 0 in all three
# channels after normalisation; a colour no grey image holds, and photos seldom do exactly.
EXACT = {"mean": [0.4, 0.2, 0.6], "std": [1 / 255] * 3}


def _erased_fractions(image_root: Path, backend: str, p: float) -> np.ndarray:
    recipe = small_recipe(image_root, augment={**EXACT, "random_erasing": p}, loader={"backend": backend})
    loader = build_loader(recipe, "train", device=CPU)
    fractions = []
    for epoch in range(4):
        loader.set_epoch(epoch)
        for batch in loader:
            erased = (batch.images == 0).all(dim=1)  # N x H x W: every channel at the fill
            fractions += erased.float().mean(dim=(1, 2)).tolist()
    loader.close()
    return np.array(fractions)


@pytest.mark.dali
@pytest.mark.parametrize("p", [1.0, 0.5])
def test_both_loaders_erase_alike(image_root: Path, p: float) -> None:
    """224 crops (4 epochs x 56) per loader: the share of images erased and the erased area
    agree within sampling error (area share: 0.02-0.33, clamped to the crop)."""
    torch_side = _erased_fractions(image_root, "torch", p)
    dali_side = _erased_fractions(image_root, "dali", p)
    for side in (torch_side, dali_side):
        assert abs((side > 0.012).mean() - p) < 0.12
        hit = side[side > 0.012]
        assert 0.12 < hit.mean() < 0.22 and hit.max() < 0.4
    assert abs(torch_side[torch_side > 0.012].mean() - dali_side[dali_side > 0.012].mean()) < 0.04


def test_no_erasing_by_default_and_bad_settings_are_refused(image_root: Path) -> None:
    assert (_erased_fractions(image_root, "torch", 0.0) < 0.012).all()
    for bad in ("augment.random_erasing=1.5", "augment.erasing_scale=[0.3, 0.1]"):
        with pytest.raises(RecipeError, match=bad.split("=")[0]):
            validate(apply_overrides(small_recipe(image_root), [bad]))
