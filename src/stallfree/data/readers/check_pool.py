"""Checking many files in worker interpreters (PIL's parse holds the GIL: threads check no
faster on 64 cores than on one): every header at start (`check_headers`), and the full decode
of `data check` and of the start-up check under data.on_error = "skip" (`decode_all`).

Started by exec, never forked: a fork copies this process as its other threads leave it, and a
reader thread (importing PIL's plugins, say) or obstore's may hold a lock that the child then
waits on forever. multiprocessing's "spawn" re-runs the caller's script in every worker.
"""

from __future__ import annotations

import itertools
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, TYPE_CHECKING, cast

from stallfree.errors import StallfreeError
from stallfree.parallel import cpu_cores

if TYPE_CHECKING:  # imported where used: a worker interpreter starts without it
    from tqdm import tqdm

CHUNK = 16  # files a decode message: small enough to keep every worker busy to the end
HEADER_CHUNK = 2048  # files a header message: ~50 ms of work, so pickling is noise
IN_PROCESS_BELOW = 20_000  # headers: fewer files are checked faster than workers start
_SRC = str(Path(__file__).resolve().parents[3])  # the folder holding this stallfree package
_SERVE = "from stallfree.data.readers.check_pool import serve; serve()"


class CheckWorkerError(StallfreeError):
    """A worker interpreter that could not start (its own error is on stderr above)."""


class WorkerDied(Exception):
    """A worker ended before it answered (a decoder crashed it, or it was killed)."""


class _Worker:
    """One checking interpreter: sent lists of paths, it answers each with their reasons."""

    def __init__(self, job: str, max_pixels: int) -> None:
        # This very package, whatever the worker's sys.path would find first.
        path = os.pathsep.join(p for p in (_SRC, os.environ.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVE, job, str(max_pixels)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": path},
        )
        try:  # it says so once its imports are done: one that cannot start is not a bad file
            pickle.load(cast(IO[bytes], self.proc.stdout))
        except (OSError, EOFError, pickle.UnpicklingError):
            self.close()
            raise CheckWorkerError(
                f"the image check's worker ({sys.executable}) exited with code "
                f"{self.proc.returncode} before it started: its error is printed above"
            ) from None

    def check(self, paths: list[str]) -> list[str | None]:
        try:
            pickle.dump(paths, cast(IO[bytes], self.proc.stdin))
            cast(IO[bytes], self.proc.stdin).flush()
            return cast(list[str | None], pickle.load(cast(IO[bytes], self.proc.stdout)))
        except (OSError, EOFError, pickle.UnpicklingError):
            self.close()
            raise WorkerDied(f"exit code {self.proc.returncode}") from None

    def close(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass  # a dead worker's pipe: nothing left to flush
        try:
            self.proc.wait(timeout=30)  # at end of input it returns between two messages
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _checked(paths: list[str], job: str, max_pixels: int, worker: _Worker) -> list[str | None]:
    """Each file's reason; when the worker dies on the chunk, each half in a fresh worker, down
    to the file that kills it, which is named bad: the rest are still checked."""
    try:
        return worker.check(paths)
    except WorkerDied as died:
        if len(paths) == 1:
            what = "decoder" if job == "decode" else "header check"
            return [f"the {what} crashed on it ({died})"]
    reasons: list[str | None] = []
    for half in (paths[: len(paths) // 2], paths[len(paths) // 2 :]):
        alone = _Worker(job, max_pixels)
        try:
            reasons += _checked(half, job, max_pixels, alone)
        finally:
            alone.close()
    return reasons


def check_all(
    paths: Iterable[str],
    job: str,
    max_pixels: int,
    workers: int,
    *,
    chunk: int,
    bar: tqdm,
) -> list[tuple[int, str, str]]:
    """(index, path, reason) of each file of `paths` that fails `job` ("headers"; "headers-pil":
    PIL alone; "decode"), in file order, checked in `workers` worker interpreters. `paths` is
    read `chunk` at a time (a lazy listing of millions is never one list)."""
    source = iter(paths)
    chunks = enumerate(iter(lambda: list(itertools.islice(source, chunk)), []))
    found: list[tuple[int, str, str]] = []
    lock, stop = threading.Lock(), threading.Event()

    def drive() -> None:  # one thread per worker: sends it chunks until none is left
        worker: _Worker | None = None
        try:
            while not stop.is_set():
                with lock:
                    number, part = next(chunks, (0, []))
                if not part:
                    return
                if worker is None or worker.proc.returncode is not None:  # none yet, or it died
                    worker = _Worker(job, max_pixels)
                reasons = _checked(part, job, max_pixels, worker)
                bad = [(number * chunk + i, part[i], r) for i, r in enumerate(reasons) if r]
                with lock:
                    found.extend(bad)
                bar.update(len(part))
        finally:
            if worker is not None:
                worker.close()

    with ThreadPoolExecutor(max(1, workers)) as pool:
        try:
            for done in [pool.submit(drive) for _ in range(max(1, workers))]:
                done.result()
        except BaseException:  # Ctrl-C, or a worker that cannot start: the others stop too
            stop.set()
            raise
    return sorted(found)


def decode_all(
    paths: list[str], max_pixels: int, workers: int, *, desc: str, progress: bool
) -> list[str | None]:
    """Fully decode `paths` in `workers` worker interpreters: the reason each one fails, or None."""
    from tqdm import tqdm

    reasons: list[str | None] = [None] * len(paths)
    count = max(1, min(workers, -(-len(paths) // CHUNK)))
    with tqdm(total=len(paths), unit="img", desc=desc, disable=not progress) as bar:
        for index, _, reason in check_all(paths, "decode", max_pixels, count, chunk=CHUNK, bar=bar):
            reasons[index] = reason
    return reasons


def check_headers(
    paths: Iterable[str], count: int, max_pixels: int, workers: int, *, progress: bool
) -> list[tuple[str, str]]:
    """(path, reason) of each of the `count` files of `paths` whose header check fails, in file
    order: in `workers` worker interpreters, or in this one for fewer than IN_PROCESS_BELOW."""
    from tqdm import tqdm

    from stallfree.data.readers.imageio import bad_headers, fast_path_on

    if count < IN_PROCESS_BELOW or workers <= 1:
        return [(e.path, e.reason) for e in bad_headers(paths, max_pixels)]
    job = "headers" if fast_path_on() else "headers-pil"
    count_workers = max(1, min(workers, -(-count // HEADER_CHUNK)))
    desc = "checking image headers"
    with tqdm(total=count, unit="img", desc=desc, disable=not progress) as bar:
        found = check_all(paths, job, max_pixels, count_workers, chunk=HEADER_CHUNK, bar=bar)
    return [(path, reason) for _, path, reason in found]


def cpu_budget(local_ranks: int) -> int:
    """This rank's share of the cores it may run on: the worker interpreters it starts (no cap:
    a 64-core node checks on 64)."""
    return max(1, cpu_cores() // max(1, local_ranks))


def serve() -> None:
    """A worker's loop: a pickled list of paths in, the list of their reasons out, until EOF."""
    job, max_pixels = sys.argv[1], int(sys.argv[2])
    if job == "decode":
        from stallfree.data.readers.imageio import register_plugins, rgb_problem

        register_plugins()
    else:  # numpy and PIL only when a file needs PIL: the common JPEG does not
        from stallfree.data.readers.fast_headers import problems
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a decoder's stray output goes to stderr, never into the replies
    requests = sys.stdin.buffer
    pickle.dump("ready", replies)
    replies.flush()
    while True:
        try:
            paths: list[str] = pickle.load(requests)
        except EOFError:
            return
        if job == "decode":
            answer = [rgb_problem(path, max_pixels) for path in paths]
        else:
            answer = problems(paths, max_pixels, fast=job == "headers")
        pickle.dump(answer, replies)
        replies.flush()
