"""A loader plug-in for tests (`loader.backend = "failing_loader:build"`): the torch backend,
whose rank named by STALLFREE_FAILING_RANK meets a data error (a DatasetError, as a corrupt file
gives) at its third batch, while the other ranks go on into that step's collectives."""

from __future__ import annotations

import os
from collections.abc import Iterator

from stallfree.data.backends import torch_backend
from stallfree.data.loader import Batch, Loader, LoaderSpec
from stallfree.data.readers.listing import DatasetError


def build(spec: LoaderSpec) -> Loader:
    loader = torch_backend.build(spec)
    if int(os.environ.get("RANK", "0")) != int(os.environ.get("STALLFREE_FAILING_RANK", "-1")):
        return loader
    batches = type(loader).__iter__

    def failing(self: Loader) -> Iterator[Batch]:
        for n, batch in enumerate(batches(self)):
            if n == 2:
                raise DatasetError("train/c1/broken.jpg: not an image (a test's failing rank)")
            yield batch

    loader.__class__ = type("FailingLoader", (type(loader),), {"__iter__": failing})
    return loader
