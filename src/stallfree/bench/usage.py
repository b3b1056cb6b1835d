"""CPU cores busy and peak PSS of a process tree (the bench's loader workers), from /proc."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


class ResourceSampler:
    """CPU cores busy and peak PSS of this process and its children (loader workers), from /proc.

    A background thread samples every `interval` s, or less often where a sample is slow (at
    most ~1% of a core); CPU time is read at enter and exit.
    """

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self.cpu_cores = float("nan")
        self.peak_pss_mb = float("nan")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ResourceSampler:
        self._cpu0, self._t0 = _tree_cpu_seconds(), time.perf_counter()
        self.peak_pss_mb = _tree_pss_mb()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        wall = time.perf_counter() - self._t0
        self.cpu_cores = (_tree_cpu_seconds() - self._cpu0) / max(wall, 1e-9)

    def _run(self) -> None:
        wait = self.interval
        while not self._stop.wait(wait):
            started = time.perf_counter()
            self.peak_pss_mb = max(self.peak_pss_mb, _tree_pss_mb())
            # A PSS read walks every page table of the tree (the kernel's smaps_account): ~10 ms
            # for a loader with workers, which at 10 a second took ~11% of the core the loader
            # was measured on. Waiting 100x a sample's time keeps the sampler under ~1%.
            wait = max(self.interval, 100 * (time.perf_counter() - started))


def _tree_pids(root: int | None = None) -> list[int]:
    """This process and all its descendants (Linux /proc; just this one elsewhere)."""
    pids, stack = [], [root or os.getpid()]
    while stack:
        pid = stack.pop()
        pids.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*/children"):
            try:
                stack.extend(int(c) for c in task.read_text().split())
            except OSError:
                continue
    return pids


def _tree_cpu_seconds() -> float:
    total = 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    for pid in _tree_pids():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
        except (OSError, IndexError, ValueError):
            continue
    return total


def _tree_pss_mb() -> float:
    """PSS of the tree, in MiB: shared pages split among the processes that map them, so
    forked workers' copy-on-write pages are not counted once per worker as RSS would."""
    total = 0
    for pid in _tree_pids():
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
                    break
        except OSError:
            continue
    return total / 1024
