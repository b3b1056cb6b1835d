"""The recipe `stallfree eval` reads a checkpoint with: the checkpoint's own by default, and a
recipe given instead held to it.

What gives the weights their meaning must match the training: the model, the class count and
each label's name, the val crop and resize, the normalisation. A difference is one error that
names both values, except a transform changed on purpose with --set on the checkpoint's own
recipe (test-time resolution is a known trick): a warning. Another data root, format or file
list is a legitimate other val set: a warning naming both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stallfree.errors import StallfreeError
from stallfree.log import LOGGER
from stallfree.recipe import Recipe, RecipeError, apply_flags, recipe_from_dict, validate

if TYPE_CHECKING:  # annotations only: eval reads the checkpoint and hands it here
    from stallfree.train.checkpoint import SavedCheckpoint


class RecipeMismatchError(StallfreeError, ValueError):
    """A recipe that would read a checkpoint's weights with another meaning; the message names
    both values and the fix."""

    same_on_every_rank = True  # every rank reads the same checkpoint and recipe


def checkpoint_recipe(checkpoint: SavedCheckpoint) -> Recipe:
    """The recipe a checkpoint was trained with."""
    if not checkpoint.has_recipe:
        raise RecipeMismatchError(f"{checkpoint.path} holds no recipe: not a stallfree checkpoint or best.pt")
    return recipe_from_dict(checkpoint.recipe, source=f"{checkpoint.path}'s recipe")


def own_recipe(trained: Recipe, flags: Mapping[str, Any], overrides: Sequence[str], path: Path) -> Recipe:
    """The checkpoint's recipe with the command's flags (typed values by recipe key) and --set
    overrides, checked (once: the caller does not check it again) with its paths."""
    from stallfree.data.readers.paths import check_paths
    from stallfree.data.registry import check_data_root

    recipe = apply_flags(trained.copy(), flags, overrides)
    recipe.model.init_from, recipe.model.pretrained = "", False  # the checkpoint holds every weight
    try:
        validate(recipe)
        check_data_root(recipe)
        check_paths(recipe, weights=False)
    except RecipeError as exc:
        with_flags = " with the flags and --set overrides" if flags or overrides else ""
        raise RecipeError(
            f"{path}'s own recipe{with_flags}: {exc} (fix it with --set, or pass a recipe)"
        ) from exc
    return recipe


def _meaning(recipe: Recipe, num_classes: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(what the weights' shapes hang on, what the val transform feeds them)."""
    aug = recipe.augment
    return {
        "model.name": recipe.model.name,
        "model.kwargs": recipe.model.kwargs,
        "the class count": num_classes,
    }, {
        "the val crop (augment.val_image_size, else the last augment.image_size)": aug.val_size,
        "augment.resize_size": aug.resize_size,
        "augment.mean": aug.mean,
        "augment.std": aug.std,
    }


def hold_to_checkpoint(
    recipe: Recipe,
    num_classes: int,
    names: list[str],
    checkpoint: SavedCheckpoint,
    *,
    given: str = "",
) -> None:
    """Refuse (or warn about) what differs between `recipe`, whose dataset has `num_classes`
    labels named `names`, and `checkpoint`. `given`: the recipe file the user passed ("" for
    the checkpoint's own, with --set overrides)."""
    from stallfree.train.export_weights import checkpoint_num_classes, class_names

    path = checkpoint.path
    trained_classes = checkpoint_num_classes(checkpoint)
    if not checkpoint.has_recipe:  # a bare state dict: only its class count can be held to the recipe
        if trained_classes != num_classes:
            raise RecipeMismatchError(
                f"{path} has {trained_classes} classes, but {recipe.data.root} has {num_classes}; "
                "evaluate it on data with the classes it was trained on"
            )
        LOGGER.warning(f"{path} holds no recipe: {given or 'the recipe'} is taken as it is, unchecked")
        return
    trained = checkpoint_recipe(checkpoint)
    source = given or "the --set overrides"
    fix = (
        f"omit {given} to evaluate with the checkpoint's own recipe (and --set a value to change "
        "it on purpose)"
        if given
        else "drop that override"
    )
    model, transform = _meaning(recipe, num_classes)
    model_then, transform_then = _meaning(trained, trained_classes)
    for key, value in model.items():
        if value != model_then[key]:
            raise RecipeMismatchError(
                f"{source}: {key} is {value!r}, but {path} was trained with {model_then[key]!r}; {fix}"
            )
    trained_names = class_names(checkpoint, trained_classes)
    if checkpoint.class_names and names != trained_names:
        label, here, then = next((i, a, b) for i, (a, b) in enumerate(zip(names, trained_names)) if a != b)
        raise RecipeMismatchError(
            f"{source}: label {label} is {here!r} in {recipe.data.root}, but {then!r} in {path}'s "
            f"training (class folders must have the training's names); {fix}"
        )
    for key, value in transform.items():
        if value == transform_then[key]:
            continue
        message = f"{source}: {key} is {value!r}, but {path} was trained with {transform_then[key]!r}"
        if given:
            raise RecipeMismatchError(f"{message}; {fix}")
        LOGGER.warning(f"{message} (evaluating with {value!r}, as asked)")
    for key in ("root", "format", "file_list"):
        here, then = getattr(recipe.data, key), getattr(trained.data, key)
        if here != then:
            LOGGER.warning(
                f"evaluating with data.{key} = {here!r} ({source}); {path} was trained with {then!r}"
            )
