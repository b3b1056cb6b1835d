"""A loader plug-in for tests (`loader.backend = "slow_loader:build"`): the torch backend,
sleeping before each batch. It gives a run wall time without CPU time, so a run can outlast a
scheduler's signal while another runs beside it on the same two cores."""

from __future__ import annotations

import time
from collections.abc import Iterator

from stallfree.data.backends.torch_backend import TorchLoader
from stallfree.data.loader import Batch, Loader, LoaderSpec

SECONDS = 0.06


class SlowLoader(TorchLoader):
    def __iter__(self) -> Iterator[Batch]:
        for batch in super().__iter__():
            time.sleep(SECONDS)
            yield batch


def build(spec: LoaderSpec) -> Loader:
    """Registry entry point."""
    return SlowLoader(spec)
