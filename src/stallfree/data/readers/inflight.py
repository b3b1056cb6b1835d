"""Reads in flight: a batch's files read by a pool of threads, ahead of their consumer, in order.

On network or object storage every read waits milliseconds (~2 ms on a network filesystem, ~20
on an object store): read one after another, a 256-image batch waits 0.5-5 s. File and socket
reads release the GIL, so threads suffice: `loader.io_depth` of them keep that many reads in
flight. The consumer takes the results in the plan's order, so which samples come, in which
order, never depends on the pool; only when their bytes arrive does.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class ReaderPool:
    """`threads` reader threads, started on first use in the process that uses them: a forked
    DataLoader worker starts its own (threads do not survive a fork), a pickled copy too."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0

    def get(self) -> ThreadPoolExecutor:
        """The pool of this process."""
        if self._pool is None or self._pid != os.getpid():
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="stallfree-read")
            self._pid = os.getpid()
        return self._pool

    def close(self) -> None:
        """Drop the reads not started yet; the ones in flight end on their own."""
        if self._pool is not None and self._pid == os.getpid():
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = None

    def __getstate__(self) -> dict[str, Any]:
        return {"threads": self.threads}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["threads"])  # type: ignore[misc]


def read_ahead(
    batches: Iterable[Sequence[T]], work: Callable[[T], R], pool: ThreadPoolExecutor, ahead: int
) -> Iterator[tuple[Sequence[T], list[Future[R]]]]:
    """Each batch with the futures of `work(item)` for its items, in order. Before a batch is
    handed out, the next `ahead` batches are submitted, so that their reads run while the
    consumer works; what is still queued when the consumer stops is cancelled."""
    window: deque[tuple[Sequence[T], list[Future[R]]]] = deque()
    source = iter(batches)
    try:
        while True:
            while len(window) <= ahead and (items := next(source, None)) is not None:
                window.append((items, [pool.submit(work, item) for item in items]))
            if not window:
                return
            yield window.popleft()
    finally:
        for _, futures in window:
            for future in futures:
                future.cancel()
