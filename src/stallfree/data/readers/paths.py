"""The paths a recipe names, checked before torch is imported: a wrong `data.root`, a missing
train/ or val/, an absent file list or init checkpoint, or a store's root that the store refuses, is
said in one line within a second, before anything is written (`train` and `eval` call it)."""

from __future__ import annotations

from pathlib import Path

from stallfree.data import storage  # torch-free, obstore lazily
from stallfree.recipe import DataConfig, Recipe
from stallfree.tables import RecipeError


def data_root(data: DataConfig) -> storage.Location:
    """`data.root` as a Location, its store's endpoint set from data.endpoint_url: the one
    place the recipe's root is parsed."""
    storage.configure(data.endpoint_url)
    return storage.locate(data.root)


def check_paths(recipe: Recipe, *, weights: bool = True) -> None:
    """The files and folders the recipe names exist: checked before torch is imported, so that
    a wrong path is said at once. `weights`: model.init_from is read (a fresh start)."""
    data = recipe.data
    try:  # before anything is written; a recipe's path, so a RecipeError naming the recipe
        if data.root:
            data_root(data).check_root(data.format, val_optional=bool(data.val_fraction))
    except storage.NoDataError as exc:
        raise RecipeError(str(exc)) from exc
    if data.file_list and not Path(data.file_list).is_file():
        raise RecipeError(
            f"data.file_list {data.file_list} does not exist; point it at a file "
            "with one image path per line (relative to data.root), or unset it"
        )
    if weights and recipe.model.init_from and not Path(recipe.model.init_from).is_file():
        raise RecipeError(
            f"model.init_from = {recipe.model.init_from}: no such file; name a "
            "checkpoint, a best.pt or a state dict of the same model"
        )
