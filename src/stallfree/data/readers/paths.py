"""The paths a recipe names, checked before torch is imported: a wrong `data.root`, a missing
train/ or val/, an absent file list or init checkpoint, or a store's root that the store refuses, is
said in one line within a second, before anything is written (`train` and `eval` call it)."""

from __future__ import annotations

from pathlib import Path

from stallfree.data import storage  # torch-free, obstore lazily
from stallfree.recipe import VAL_FIX, Recipe
from stallfree.tables import RecipeError


def check_paths(recipe: Recipe, *, weights: bool = True) -> None:
    """The files and folders the recipe names exist: checked before torch is imported, so that
    a wrong path is said at once. `weights`: model.init_from is read (a fresh start)."""
    data = recipe.data
    if data.root and not storage.open(data.root).is_local:  # before anything is written
        storage.check_root(data.root, data.format, data.endpoint_url)
    elif data.root:
        root = Path(data.root)
        if not root.is_dir():
            hint = (
                " (run `stallfree data demo data/demo` to build the demo data)" if "demo" in data.root else ""
            )
            raise RecipeError(f"data.root {root} does not exist{hint}")
        for split in ("train", "val") if data.format == "folder" else ():
            if not (root / split).is_dir() and not (split == "val" and data.val_fraction):
                fix = VAL_FIX if split == "val" else ""
                raise RecipeError(
                    f"data.root {root} has no {split}/ folder; expected {root}/{split}/<class>/<image>{fix}"
                )
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
