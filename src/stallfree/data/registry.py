"""Loader backends by name, imported lazily: DALI is needed only when `--loader dali` is chosen.

Torch-free, so the CLI can list the backends without importing torch.
"""

from __future__ import annotations

import importlib
import importlib.util
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

# The loaders people pick instead (stallfree.bench_peers), by name -> (builder, module needed).
PEERS: dict[str, tuple[str, str]] = {
    "peer-pil": ("stallfree.bench_peers:pil_plain", "PIL"),
    "peer-webdataset": ("stallfree.bench_peers:webdataset_peer", "webdataset"),
    "peer-torchvision": ("stallfree.bench_peers:torchvision_peer", "torchvision"),
}

# What `stallfree bench --backends` can run: name -> the recipe overrides that select it, the
# same `loader.backend` override `train` takes (one channel, so a bench row is a train run's
# loader). Every registered backend under its own name, and some settings worth a row:
# torch-naive (the textbook DataLoader), torch-uint8 (a GPU run's worker output, on a CPU),
# dali-cpudecode (NVIDIA's "dali-cpu" mode: decode on the CPU, augment on the GPU).
BENCH_VARIANTS: dict[str, tuple[str, ...]] = {
    **{name: (f'loader.backend="{name}"',) for name in BACKENDS},
    "dali-cpudecode": ('loader.backend="dali"', 'loader.dali.decode="cpu"'),
    "torch-naive": ('loader.backend="stallfree.data.naive:build"',),
    "torch-uint8": ('loader.backend="stallfree.data.torch_backend:build_uint8"',),
    **{name: (f'loader.backend="{target}"',) for name, (target, _) in PEERS.items()},
}


def installed_peers() -> list[str]:
    """The peers whose library is importable here."""
    return [name for name, (_, module) in PEERS.items() if importlib.util.find_spec(module)]


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
