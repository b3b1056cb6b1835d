"""`build_loader`: a rank's Loader of one split, from the `LoaderSpec` its RunContext makes
(train/prepare.py) and the resolved backend (its typed options, "auto" counts already decided
by data/autotune.py, which `measure_auto_count` calls).

Kept apart from the contract (data/loader.py) so that the contract imports no orchestration:
autotune times Loaders, and this module, which calls it, sits above both.
"""

from __future__ import annotations

from typing import Any

import torch

from stallfree.data.autotune import asks_auto, tuned_count, tuned_key
from stallfree.data.loader import Loader, LoaderSpec
from stallfree.data.registry import ResolvedBackend


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


def build_loader(spec: LoaderSpec, backend: ResolvedBackend) -> Loader:
    """Build `backend`'s loader from `spec` (RunContext.loader_spec: one split, this rank, the
    listed dataset, images in the run's autocast dtype). `backend`: the run's, resolved once,
    its "auto" count decided (RunContext.with_loader_counts)."""
    if asks_auto(backend):
        raise ValueError(
            f'{tuned_key(backend)} = "auto": decide it before building loaders '
            "(RunContext.with_loader_counts, which stallfree.loader() and every command call)"
        )
    return backend.build(spec)


def measure_auto_count(spec: LoaderSpec, backend: ResolvedBackend) -> tuple[int, dict[str, Any] | None]:
    """The count `workers`/`threads = "auto"` takes for this run, timed on loaders built from
    `spec` (the train split's; data/autotune.py), and the figures."""
    return tuned_count(spec, backend)
