"""`build_loader`: a rank's Loader of one split, from a recipe, its dataset and its resolved
backend (the backend's typed options, "auto" counts already decided by data/autotune.py).

Kept apart from the contract (data/loader.py) so that the contract imports no orchestration:
autotune times Loaders, and this module, which calls it, sits above both.
"""

from __future__ import annotations

from typing import Any

import torch

from stallfree.data.autotune import asks_auto, tuned_count, tuned_key
from stallfree.data.loader import Loader, LoaderSpec
from stallfree.data.readers.folders import Dataset, class_count
from stallfree.data.registry import BackendError, ResolvedBackend
from stallfree.parallel import DistInfo
from stallfree.recipe import Recipe


def loader_dtype(precision: str, device: torch.device) -> torch.dtype:
    """Images arrive in the autocast dtype on CUDA (half the bytes); float32 on CPU."""
    if precision == "auto":
        raise ValueError(
            "resolve train.precision before building loaders (stallfree.train.precision."
            "resolve_precision), or build them with stallfree.loader(), which resolves it as the CLI does"
        )
    if device.type == "cuda" and precision in ("bf16", "fp16"):
        return torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.float32


def build_loader(
    recipe: Recipe,
    split: str,
    *,
    device: torch.device,
    dist: DistInfo,
    dataset: Dataset | None,
    backend: ResolvedBackend,
    precision: str,
) -> Loader:
    """Build the backend's loader of `split` ("train" or "val") for this rank from the listed
    dataset. `backend`: the run's, resolved once, its "auto" count decided (RunContext);
    `precision`: the run's, "auto" decided (images arrive in its autocast dtype)."""
    if asks_auto(backend):
        raise ValueError(
            f'{tuned_key(backend)} = "auto": decide it before building loaders '
            "(RunContext.with_loader_counts, which stallfree.loader() and every command call)"
        )
    return backend.build(loader_spec(recipe, split, device, dist, dataset, backend, precision))


def measure_auto_count(
    recipe: Recipe,
    backend: ResolvedBackend,
    *,
    device: torch.device,
    dist: DistInfo,
    dataset: Dataset | None,
    precision: str,
) -> tuple[int, dict[str, Any] | None]:
    """The count `workers`/`threads = "auto"` takes for this run (timed on the train split,
    data/autotune.py), and the figures."""
    spec = loader_spec(recipe, "train", device, dist, dataset, backend, precision)
    return tuned_count(spec, backend)


def loader_spec(
    recipe: Recipe,
    split: str,
    device: torch.device,
    dist: DistInfo,
    dataset: Dataset | None,
    backend: ResolvedBackend,
    precision: str,
) -> LoaderSpec:
    """What every backend is built from: the recipe's facts and the backend's typed options."""
    if dataset is None and backend.needs_data:
        raise BackendError(f"loader backend {backend.name!r} needs data.root; set --set data.root=PATH")
    return LoaderSpec(
        split=split,
        listing=dataset.splits[split] if dataset else None,
        num_classes=class_count(recipe, dataset),
        augment=recipe.augment,
        loader=recipe.loader,
        batch_size=recipe.train.batch_size,
        seed=recipe.train.seed,
        device=device,
        dtype=loader_dtype(precision, device),
        channels_last=recipe.train.channels_last,
        dist=dist,
        max_pixels=recipe.data.max_pixels,
        on_error=recipe.data.on_error,
        synthetic_samples=recipe.data.synthetic_samples,
        sources=dataset.sources if dataset else (),
        checked_by=dataset.checked_by if dataset else None,
        options=backend.options,
    )
