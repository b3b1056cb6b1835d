"""A read that waits on a store that does not answer is said within seconds, not only when its
attempt times out (a frozen store, SIGSTOP'd say, holds each attempt for its whole timeout)."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import stallfree.data.storage.settings as settings
from stallfree.log import LOGGER

STALL_S = 5.0  # a request this old has not been answered: the store is said to be stalled
_inflight: dict[int, tuple[str, float]] = {}
_ids = itertools.count()
_lock = threading.Lock()
_watcher = {"pid": 0}
_said = [0.0]  # when this process last said so (at most once every 30 s)


@contextmanager
def watched(url: str) -> Iterator[None]:
    """Around one request of `url`: said once it has waited STALL_S seconds."""
    ident = next(_ids)
    _inflight[ident] = (url, time.monotonic())
    if _watcher["pid"] != os.getpid():
        _start()
    try:
        yield
    finally:
        _inflight.pop(ident, None)


def _start() -> None:
    with _lock:
        if _watcher["pid"] == os.getpid():
            return
        _watcher["pid"] = os.getpid()
        threading.Thread(target=_watch, name="stallfree-store-stalls", daemon=True).start()


def _watch() -> None:
    while True:
        time.sleep(1.0)
        now = time.monotonic()
        oldest = min(list(_inflight.values()), key=lambda item: item[1], default=None)
        if oldest is None or now - oldest[1] < STALL_S or now - _said[0] < 30:
            continue
        _said[0] = now
        LOGGER.warning(
            f"{oldest[0]}: no answer from the store for {now - oldest[1]:.0f} s; waiting up to "
            f"{settings.outage_budget():.0f} s for it ({settings.OUTAGE_ENV})"
        )


def _after_fork() -> None:
    _inflight.clear()  # the parent's requests are not this process's


os.register_at_fork(after_in_child=_after_fork)
