"""Reads in flight: a batch's files read by a pool of threads, ahead of their consumer, in order.

On network or object storage every read waits milliseconds (~2 ms on a network filesystem, ~20
on an object store): read one after another, a 256-image batch waits 0.5-5 s. File and socket
reads release the GIL, so threads suffice: `loader.io_depth` of them keep that many reads in
flight. The consumer takes the results in the plan's order, so which samples come, in which
order, never depends on the pool; only when their bytes arrive does.
"""

from __future__ import annotations

import itertools
import os
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from stallfree.data import storage
from stallfree.data.readers.imageio import register_plugins

T = TypeVar("T")
R = TypeVar("R")


def reads_in_flight(io_depth: int | str, root: str) -> int:
    """`loader.io_depth` as a number of reader threads for data under `root`."""
    if io_depth != "auto":
        return int(io_depth)
    return storage.locate(root).store.reads_in_flight


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
            register_plugins()  # no reader thread imports one lazily (a fork-safe process)
            # A loader's reads: each reader thread makes its object requests itself.
            self._pool = ThreadPoolExecutor(
                self.threads, thread_name_prefix="stallfree-read", initializer=storage.enable_direct
            )
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


Window = deque[tuple[Sequence[T], list[Future[R]]]]


class HeldReads:
    """Reads submitted past the end of one run of batches for the run expected next (the next
    epoch's first batches): held under that run's key, handed over when a run with that key
    starts, cancelled when another one does."""

    def __init__(self) -> None:
        self.key: Hashable = None
        self.window: Window[Any, Any] = deque()

    def take(self, key: Hashable) -> Window[Any, Any]:
        """The reads held for `key` (none for any other key: those are cancelled)."""
        window, held = self.window, self.key
        self.key, self.window = None, deque()
        if held == key and key is not None:
            return window
        _cancel(window)
        return deque()

    def hold(self, key: Hashable, window: Window[Any, Any]) -> None:
        """Keep `window` for the run `key`; what was held before is cancelled."""
        _cancel(self.take(None))
        self.key, self.window = key, window

    def cancel(self) -> None:
        """Cancel what is held."""
        self.hold(None, deque())


def submit(
    batches: Iterable[Sequence[T]], work: Callable[[T], R], pool: ThreadPoolExecutor, count: int
) -> Window[T, R]:
    """The first `count` of `batches` with the futures of their reads (to `HeldReads.hold`)."""
    return deque(
        (items, [pool.submit(work, item) for item in items]) for items in itertools.islice(batches, count)
    )


def read_ahead(
    batches: Iterable[Sequence[T]],
    work: Callable[[T], R],
    pool: ThreadPoolExecutor,
    ahead: int,
    carried: Window[T, R] | None = None,
    next_run: tuple[HeldReads, Hashable, Iterable[Sequence[T]]] | None = None,
) -> Iterator[tuple[Sequence[T], list[Future[R]]]]:
    """Each batch with the futures of `work(item)` for its items, in order. Before a batch is
    handed out, the next `ahead` batches are submitted, so that their reads run while the
    consumer works; what is still queued when the consumer stops is cancelled.

    `carried`: the reads of the first batches of `batches`, submitted earlier (`HeldReads.take`).
    `next_run` = (held, key, the batches expected next): as this run's last batches are handed
    out, the window fills from those, and once this run has ended they are held in `held`
    under `key`, so that the next run's first reads are in flight before it starts.
    """
    window: Window[T, R] = carried if carried is not None else deque()
    source = itertools.islice(iter(batches), len(window), None)  # the carried ones are in
    following: Window[T, R] = deque()
    after = iter(next_run[2]) if next_run is not None else iter(())
    ended = False
    try:
        while True:
            while len(window) <= ahead and (items := next(source, None)) is not None:
                window.append((items, [pool.submit(work, item) for item in items]))
            while len(window) + len(following) <= ahead and (items := next(after, None)) is not None:
                following.append((items, [pool.submit(work, item) for item in items]))
            if not window:
                ended = True
                return
            yield window.popleft()
    finally:
        _cancel(window)
        if next_run is not None and ended:
            next_run[0].hold(next_run[1], following)
        else:
            _cancel(following)


def _cancel(window: Window[Any, Any]) -> None:
    for _, futures in window:
        for future in futures:
            future.cancel()
