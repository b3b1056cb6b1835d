"""Loader backends by name, imported lazily: DALI is needed only when `--loader dali` is chosen.

Torch-free, so the CLI can list the backends without importing torch.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stallfree.errors import StallfreeError
from stallfree.recipe import LoaderConfig, Recipe
from stallfree.tables import RecipeError, table_from_dict


class BackendError(StallfreeError, ValueError):
    """An unknown backend or one whose optional dependency is missing."""

    same_on_every_rank = True


@dataclass(frozen=True)
class Backend:
    """What stallfree knows of a backend, in one place: its builder ("module:function", taking
    a LoaderSpec and returning a Loader), the `[loader.<table>]` of its own keys (typed in
    recipe.py, so that a recipe is checked without importing torch or DALI), and the key of
    that table that `"auto"` tunes (data/autotune.py); whether it reads data.root, and the
    loader key naming the backend it wraps (synthetic-decode's)."""

    builder: str
    table: str = ""
    tuned: str = ""
    needs_data: bool = True
    wraps: str = ""


BACKENDS: dict[str, Backend] = {
    "torch": Backend("stallfree.data.backends.torch_backend:build", table="torch", tuned="workers"),
    "synthetic": Backend("stallfree.data.backends.synthetic:build", needs_data=False),
    "dali": Backend("stallfree.data.backends.dali_backend:build", table="dali", tuned="threads"),
    # Its own key is loader.synthetic_decode; the pipeline it wraps reads that one's table.
    "synthetic-decode": Backend("stallfree.data.backends.synthetic_decode:build", wraps="synthetic_decode"),
}
# A `module:function` plug-in's keys: checked against the dataclass its builder declares as
# `build.options = MyOptions` (every field with a default), like the built-in tables.
PLUGIN_TABLE = "plugin"
# Resolved before any backend is built (stallfree.data.choose), so not a builder of its own.
AUTO = "auto"


def needs_data(name: str) -> bool:
    """Whether backend `name` reads data.root: all but synthetic ("auto" and a plug-in do)."""
    entry = BACKENDS.get(name)
    return entry.needs_data if entry is not None else True


def check_data_root(recipe: Recipe) -> None:
    """A backend that reads data.root needs one: refused before torch loads, with the fix."""
    if needs_data(recipe.loader.backend) and not recipe.data.root:
        raise RecipeError(
            f"loader.backend = {recipe.loader.backend!r} reads data.root, which is "
            "empty; set it in the recipe or with --set data.root=PATH"
        )


def resolve_backend(name: str) -> Callable[..., Any]:
    """Look up a registered backend, or a `module:function` plug-in."""
    target = BACKENDS[name].builder if name in BACKENDS else name if ":" in name else None
    if target is None:
        raise BackendError(
            f"unknown loader backend {name!r}; available: {', '.join(BACKENDS)} "
            "or a plug-in given as 'module:function'"
        )
    module_name, _, func = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise BackendError(f"loader backend {name!r} could not be imported: {exc}") from exc
    if not callable(getattr(module, func, None)):
        raise BackendError(f"loader backend {name!r}: {module_name} has no function {func!r}")
    return getattr(module, func)


@dataclass(frozen=True, slots=True)
class ResolvedBackend:
    """A run's loader backend, resolved once (`resolve`): its name, builder, typed options (the
    `[loader.<table>]` object, a plug-in's declared dataclass, or None), its registry entry
    (None for a plug-in) and, for a wrapper (synthetic-decode), the backend it wraps."""

    name: str
    build: Callable[..., Any]
    options: Any = None
    entry: Backend | None = None
    inner: ResolvedBackend | None = None

    @property
    def knob(self) -> tuple[str, str] | None:
        """(table, key) of the count `"auto"` tunes, as the registry entry declares, or None."""
        return (self.entry.table, self.entry.tuned) if self.entry and self.entry.tuned else None

    @property
    def needs_data(self) -> bool:
        return needs_data(self.name)


def resolve(loader: LoaderConfig, name: str | None = None) -> ResolvedBackend:
    """`name` (default `loader.backend`) with its builder and typed options from `loader`;
    "auto" must be decided before (stallfree.data.choose). Reads only: a plug-in's options
    come back typed, `loader.plugin` is left as it is (prepare_recipe records the defaults)."""
    name = name or loader.backend
    if name == AUTO:
        raise BackendError('resolve loader.backend = "auto" first (stallfree.data.choose.resolve_auto)')
    build = resolve_backend(name)
    entry = BACKENDS.get(name)
    if entry is not None:
        inner = resolve(loader, getattr(loader, entry.wraps)) if entry.wraps else None
        options = getattr(loader, entry.table) if entry.table else inner
        return ResolvedBackend(name, build, options, entry, inner)
    return ResolvedBackend(name, build, _plugin_options(loader, name, build))


def _plugin_options(loader: LoaderConfig, name: str, build: Callable[..., Any]) -> Any:
    """A plug-in's `[loader.plugin]`, checked against the dataclass its builder declares."""
    declared = getattr(build, "options", None)
    where = f"[loader.{PLUGIN_TABLE}] (for loader.backend = {name!r})"
    if declared is None:
        if loader.plugin:
            raise RecipeError(
                f"{where} sets {', '.join(loader.plugin)}, but the plug-in declares "
                "no options: give its builder `build.options = SomeDataclass` "
                "naming them, or remove the table"
            )
        return None
    if not isinstance(declared, type) or not dataclasses.is_dataclass(declared):
        raise BackendError(f"plug-in {name!r}: its `options` must be a dataclass class, got {declared!r}")
    return table_from_dict(declared, loader.plugin, f"loader.{PLUGIN_TABLE}", where)
