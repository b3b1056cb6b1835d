"""stallfree: train PyTorch image classifiers without data stalls.

The public API is what `__all__` lists (tests/unit/test_api.py holds it to its names and signatures);
everything else is internal. Every error a user can cause is a `StallfreeError`, one line that
names the file, key or value and the fix. `import stallfree` does not import torch: `Loader` and
`Batch` load it when first named, `loader()` when called.
"""

from __future__ import annotations

from typing import Any

from stallfree.api import loader
from stallfree.errors import StallfreeError
from stallfree.version import __version__

__all__ = ["Batch", "Loader", "StallfreeError", "__version__", "loader"]


def __getattr__(name: str) -> Any:
    """`Batch` and `Loader`, the types `loader()` returns, imported (with torch) on first use."""
    if name in ("Batch", "Loader"):
        from stallfree.data import loader as contract

        return getattr(contract, name)
    raise AttributeError(f"module 'stallfree' has no attribute {name!r}")
