"""A loader plug-in for tests (`loader.backend = "slow_loader:build"`): the torch backend,
sleeping before each batch. It gives a run wall time without CPU time, so a run can outlast a
scheduler's signal while another runs beside it on the same two cores.

It sleeps only while the file named by STALLFREE_SLOW_LOADER_UNTIL does not exist: a test that
has seen what it waited for (a signal honoured) creates it, and the rest of the run goes at full
speed. The sleep changes no batch, so the weights are those of a run that never slept.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

from stallfree.data.backends.torch_backend import TorchLoader
from stallfree.data.loader import Batch, Loader, LoaderSpec

SECONDS = 0.4  # long sleeps over few epochs: the full-speed rest after the signal is short


class SlowLoader(TorchLoader):
    def __iter__(self) -> Iterator[Batch]:
        until = os.environ.get("STALLFREE_SLOW_LOADER_UNTIL", "")
        for batch in super().__iter__():
            if not (until and os.path.exists(until)):
                time.sleep(SECONDS)
            yield batch


def build(spec: LoaderSpec) -> Loader:
    """Registry entry point."""
    return SlowLoader(spec)
