"""`stallfree.loader`: the loaders `stallfree train` builds, for a loop of your own.

Imported by `stallfree/__init__.py`, so it imports nothing heavy at module level: torch and the
backends load when `loader()` is called, and `import stallfree` stays as light as the CLI's start.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from stallfree.data.loader import Loader
    from stallfree.parallel import DistInfo
    from stallfree.recipe import Recipe

SPLITS = ("train", "val")


def loader(
    recipe: str | os.PathLike[str] | Recipe | Mapping[str, Any],
    split: str = "train",
    *,
    rank: int | None = None,
    world_size: int | None = None,
    device: str | torch.device | None = None,
    overrides: str | Iterable[str] = (),
    **fields: Any,
) -> Loader:
    """This rank's loader of `split`, resolved and built exactly as `stallfree train` builds it.

    `overrides` are `--set` strings: a list of them, or one.
    """
    import torch

    from stallfree.data.registry import check_data_root
    from stallfree.recipe import RecipeError, apply_flags, validate
    from stallfree.train.prepare import prepare_recipe

    if split not in SPLITS:
        raise RecipeError(f"stallfree.loader: split {split!r}; choose one of {', '.join(SPLITS)}")
    given = _load(recipe)
    # train.device names a kind; a device with an index (or the CPU) is handed to prepare.
    flags = {"train.device": torch.device(device).type} if device is not None else {}
    apply_flags(given, flags, [overrides] if isinstance(overrides, str) else list(overrides))
    _set_fields(given, fields)
    # The CLI's order (cli.py, train/run.py): check the recipe once, resolve precision, device
    # and backend, list the dataset once, decide "auto" worker/thread counts, then build.
    validate(given)
    check_data_root(given)
    # Precision, `--loader auto`'s probe and "auto" counts are resolved on the device given.
    # A bare "cuda" is this rank's GPU (LOCAL_RANK), as train.device = "cuda" means.
    exact = torch.device(device) if device is not None else None
    exact = exact if exact is None or exact.index is not None or exact.type == "cpu" else None
    ctx = prepare_recipe(given, _dist(rank, world_size), exact).with_dataset().with_loader_counts()
    return ctx.loader(split)


def _load(recipe: str | os.PathLike[str] | Recipe | Mapping[str, Any]) -> Recipe:
    """A private copy of the recipe: a TOML path, a Recipe, or its nested-dict form."""
    from stallfree.recipe import Recipe, RecipeError, load_recipe, recipe_from_dict

    if isinstance(recipe, (str, os.PathLike)):
        return load_recipe(Path(recipe))
    if isinstance(recipe, Recipe):
        return recipe.copy()
    if isinstance(recipe, Mapping):
        return recipe_from_dict(dict(recipe), source="stallfree.loader(recipe=...)")
    raise RecipeError(
        f"stallfree.loader: recipe is a {type(recipe).__name__}; pass a TOML path, a Recipe or a dict"
    )


def _set_fields(recipe: Recipe, fields: Mapping[str, Any]) -> None:
    """Keyword overrides, `section__key=value` (`loader__torch__workers=0`), after the strings."""
    from stallfree.recipe import RecipeError, set_key

    for name, value in fields.items():
        dotted = name.replace("__", ".")
        if "." not in dotted:
            raise RecipeError(
                f"stallfree.loader({name}=...): expected SECTION__KEY=value, e.g. train__batch_size=8"
            )
        set_key(recipe, dotted, value, f"stallfree.loader({name}=...)")


def _dist(rank: int | None, world_size: int | None) -> DistInfo:
    """The ranks: as given, else the initialised process group's, else torchrun's environment
    (or an srun step's), else one process."""
    import torch.distributed as td

    from stallfree.parallel import DistInfo
    from stallfree.recipe import RecipeError

    env = DistInfo.from_env()
    if rank is None and world_size is None:
        if not (td.is_available() and td.is_initialized()):
            return env
        rank, world_size = td.get_rank(), td.get_world_size()
    if rank is None or world_size is None or not 0 <= rank < world_size:
        raise RecipeError(
            f"stallfree.loader: rank={rank}, world_size={world_size}; give both, with 0 <= rank < world_size"
        )
    if (env.rank, env.world_size) == (rank, world_size):
        return env  # the launcher's local ranks too: they share out the node's cores and GPUs
    # Ranks given without a launcher: read as one node's (each takes its share of the cores).
    return DistInfo(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size)
