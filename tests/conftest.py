"""Shared fixtures: tiny datasets written into tmp dirs, and the CUDA marker."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import pytest
import torch

from stallfree.data.tools.demo import write_demo

HAS_DALI = importlib.util.find_spec("nvidia.dali") is not None
# Start-up check results, packed peer shards and the like go to a cache of the test session
# (inherited by every subprocess), not into the user's ~/.cache.
_CACHE = tempfile.TemporaryDirectory(prefix="stallfree-test-cache-")
os.environ.setdefault("STALLFREE_CACHE", _CACHE.name)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_dali = pytest.mark.skip(reason="needs nvidia-dali (pip install -e '.[dali]')")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "dali" in item.keywords and not HAS_DALI:
            item.add_marker(skip_dali)


@pytest.fixture(scope="session")
def image_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 10-class demo ImageFolder: 6 train and 3 val images per class (photo-like sizes)."""
    return write_demo(
        tmp_path_factory.mktemp("demo"),
        train_per_class=6,
        val_per_class=3,
        seed=1,
        gray_every=4,
        progress=False,
    )
