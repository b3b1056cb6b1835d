"""`loader.torch.workers = "auto"` and `loader.dali.threads = "auto"`: measured, not guessed.

Once a run, before its first step (`RunContext.with_loader_counts`), the loader is built with
each count around this rank's share of the cores and timed on the training split; the fastest
is kept for every loader of the run. All ranks of a node measure at once, so each count is timed
under the contention it will train under. The count goes into the run's Resolved record (not the
recipe, which keeps "auto"), and a resume takes it from its checkpoint's (`chosen_before`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import TYPE_CHECKING, Any

from stallfree.log import LOGGER
from stallfree.parallel import cpu_workers

if TYPE_CHECKING:  # annotations only: data/build.py calls this one, never the reverse
    from stallfree.data.loader import Loader, LoaderSpec
    from stallfree.data.registry import ResolvedBackend
    from stallfree.resolved import Resolved

IMAGES = 256  # timed per candidate: enough to average over decode sizes, a second or two


def tuned_key(backend: ResolvedBackend) -> str:
    """The dotted recipe key "auto" tunes for `backend`, e.g. loader.torch.workers ("" if none)."""
    return f"loader.{backend.knob[0]}.{backend.knob[1]}" if backend.knob else ""


def asks_auto(backend: ResolvedBackend) -> bool:
    """Whether `backend`'s tuned count is "auto" in its options."""
    return backend.knob is not None and getattr(backend.options, backend.knob[1]) == "auto"


def chosen_before(previous: Resolved | None, backend: ResolvedBackend) -> int | None:
    """The count "auto" chose at this run's start, from its checkpoint's Resolved record; None
    when that record holds none (another backend, or no "auto" asked)."""
    knob = backend.knob
    if previous is None or knob is None or previous.backend != backend.name:
        return None
    count: int = getattr(previous, knob[1])  # the record names it as the key: workers, threads
    return count or None


def with_count(backend: ResolvedBackend, count: int) -> ResolvedBackend:
    """`backend` whose typed options hold `count` in the tuned key (the recipe keeps "auto")."""
    if backend.knob is None:
        raise ValueError(f'backend {backend.name!r} has no count that "auto" tunes')
    options = dataclasses.replace(backend.options, **{backend.knob[1]: count})
    return dataclasses.replace(backend, options=options)


def tuned_count(spec: LoaderSpec, backend: ResolvedBackend) -> tuple[int, dict[str, Any]]:
    """The count "auto" takes for `spec` (measured now), and the figures."""
    if backend.knob is None:
        raise ValueError(f'backend {backend.name!r} has no count that "auto" tunes')
    return _measure(spec, backend)


def _with_count(spec: LoaderSpec, backend: ResolvedBackend, count: int) -> LoaderSpec:
    """`spec` whose typed options hold `count` in the tuned key."""
    assert backend.knob is not None
    return dataclasses.replace(spec, options=dataclasses.replace(spec.options, **{backend.knob[1]: count}))


def candidates(local_world_size: int) -> list[int]:
    """Counts around this rank's share of the cores: share - 1, share, share + 1 (never 0: the
    main process trains)."""
    share = cpu_workers(-1, local_world_size)
    return sorted({max(1, share - 1), share, share + 1})


def _rate(loader: Loader, batch_size: int, batches: int) -> float:
    """Images/s after the first batch, over `batches` more: worker or pipeline start-up is paid
    once a run, not per batch."""
    iterator = iter(loader)
    next(iterator)
    started = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * batch_size / (time.perf_counter() - started)


def _measure(spec: LoaderSpec, backend: ResolvedBackend) -> tuple[int, dict[str, Any]]:
    """The fastest candidate count, and the figures that go to the log and autotune.json."""
    key = tuned_key(backend)
    rates: dict[int, float] = {}
    started = time.perf_counter()
    for count in candidates(spec.dist.local_world_size):
        loader = backend.build(_with_count(spec, backend, count))
        try:
            batches = min(max(2, math.ceil(IMAGES / spec.batch_size)), len(loader) - 1)
            if batches < 1:  # a split too small to time: this rank's share, unmeasured
                share = cpu_workers(-1, spec.dist.local_world_size)
                return share, {"key": key, "chosen": share, "note": "too few batches to time"}
            rates[count] = _rate(loader, spec.batch_size, batches)
        finally:
            loader.close()
    chosen = max(rates, key=rates.__getitem__)
    figures = {
        "key": key,
        "chosen": chosen,
        "images_per_s": {str(k): round(v, 1) for k, v in rates.items()},
        "images_each": batches * spec.batch_size,
        "seconds": round(time.perf_counter() - started, 1),
    }
    if spec.dist.rank == 0:
        LOGGER.info(
            f"{key} = auto: {chosen} (" + ", ".join(f"{k}: {v:.0f} img/s" for k, v in rates.items()) + ")"
        )
    return chosen, figures
