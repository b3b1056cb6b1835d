"""Loader backends by name, imported lazily: DALI is needed only when `--loader dali` is chosen.

Torch-free, so the CLI can list the backends without importing torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from stallfree.errors import StallfreeError


class BackendError(StallfreeError, ValueError):
    """An unknown backend or one whose optional dependency is missing."""


# name -> "module:function"; the function takes a LoaderSpec and returns a Loader.
BACKENDS: dict[str, str] = {
    "torch": "stallfree.data.torch_backend:build",
    "synthetic": "stallfree.data.synthetic:build",
    "dali": "stallfree.data.dali_backend:build",
    "synthetic-decode": "stallfree.data.synthetic_decode:build",
}
# Resolved before any backend is built (stallfree.data.auto), so not a builder of its own.
AUTO = "auto"


def resolve_backend(name: str) -> Callable[..., Any]:
    """Look up a registered backend, or a `module:function` plug-in."""
    target = BACKENDS.get(name, name if ":" in name else None)
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
