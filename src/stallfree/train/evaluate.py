"""`stallfree eval`: a checkpoint's top-1, top-5 and loss on the val split, on one process or many.

Every val sample is read exactly once across ranks (see `ShardPlan`), so the figures and the
sample count are the same on 1 and on N ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from stallfree.models import build_model
from stallfree.parallel import DistInfo
from stallfree.recipe import Recipe
from stallfree.train.accuracy import evaluate_model
from stallfree.train.checkpoint import SavedCheckpoint, resolve_checkpoint
from stallfree.train.distributed import init_distributed, shutdown
from stallfree.train.precision import PrecisionPolicy
from stallfree.train.prepare import prepare
from stallfree.train.recipe_match import checkpoint_recipe, hold_to_checkpoint, own_recipe


def evaluate_checkpoint(
    recipe: Recipe | None,
    checkpoint: str | Path,
    *,
    flags: Mapping[str, Any] | None = None,
    overrides: Sequence[str] = (),
    given: str = "",
) -> dict[str, Any]:
    """Load the checkpoint's weights into the recipe's model and evaluate the val split
    (top-1, top-5, the mean cross-entropy without label smoothing, and the samples read).

    `recipe` None: the checkpoint's own, with the command's `flags` (typed values by recipe
    key) and `overrides`, and its "auto" worker/thread count; a recipe (from the file `given`,
    checked by the caller) is held to the checkpoint's: classes, their names, sizes and
    normalisation (recipe_match)."""
    dist = DistInfo.from_env()
    checkpoint = resolve_checkpoint(checkpoint)
    saved = SavedCheckpoint.read(checkpoint)
    previous = None
    if recipe is None:
        recipe = own_recipe(checkpoint_recipe(saved), flags or {}, overrides, checkpoint)
        previous = saved.resolved
    else:  # held to the checkpoint as strictly as a file (a Python caller passes none)
        given = given or "the recipe given"
    ctx = prepare(recipe, dist, previous)
    recipe, device = ctx.recipe, ctx.device
    hold_to_checkpoint(recipe, ctx.num_classes, ctx.class_names, saved, given=given)
    init_distributed(dist, device)
    loader = ctx.loader("val")
    try:
        model = build_model(recipe.model, ctx.num_classes, load_pretrained=False)
        model.load_state_dict(saved.weights())
        if recipe.train.channels_last:
            # torch's stubs omit Module.to's memory_format, which it accepts (as `Tensor.to` does)
            model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        policy = PrecisionPolicy(ctx.resolved.precision, device.type)
        result = evaluate_model(model.to(device), loader, policy, device, dist)
    finally:
        loader.close()
    shutdown()
    return {
        "val_top1": result["val_top1"],
        "val_top5": result["val_top5"],
        "val_loss": result["val_loss"],
        "samples": result["val_samples"],
        "checkpoint": str(checkpoint),
        "precision": ctx.resolved.precision,
        "world_size": dist.world_size,
    }
