"""Fully decoding many files, `workers` at a time, each worker an interpreter of its own: the
start-up check under data.on_error = "skip" and `stallfree data check`.

The workers are started by exec (subprocess), never forked: a fork copies this process as its
other threads leave it, and a loader's reader threads (importing PIL's plugins, say) or
obstore's may hold a lock that the child then waits on forever. multiprocessing's "spawn" and
"forkserver" exec too, but re-run the caller's script in every worker (one without a
`__main__` guard would start over); these import only this module.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, cast

from tqdm import tqdm

from stallfree.errors import StallfreeError

CHUNK = 16  # files a message: small enough to keep every worker busy to the end
_SRC = str(Path(__file__).resolve().parents[3])  # the folder holding this stallfree package
_SERVE = "from stallfree.data.readers.decode_pool import serve; serve()"


class DecodeWorkerError(StallfreeError):
    """A worker interpreter that could not start (its own error is on stderr above)."""


class _Died(Exception):
    """A worker ended before it answered (a decoder crashed it, or it was killed)."""


class _Worker:
    """One decoding interpreter: sent lists of paths, it answers each with their reasons."""

    def __init__(self, max_pixels: int) -> None:
        # This very package, whatever the worker's sys.path would find first.
        path = os.pathsep.join(p for p in (_SRC, os.environ.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVE, str(max_pixels)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": path},
        )
        try:  # it says so once its imports are done: one that cannot start is not a bad file
            pickle.load(cast(IO[bytes], self.proc.stdout))
        except (OSError, EOFError, pickle.UnpicklingError):
            self.close()
            raise DecodeWorkerError(
                f"the image check's worker ({sys.executable}) exited with code "
                f"{self.proc.returncode} before it started: its error is printed above"
            ) from None

    def decode(self, paths: list[str]) -> list[str | None]:
        try:
            pickle.dump(paths, cast(IO[bytes], self.proc.stdin))
            cast(IO[bytes], self.proc.stdin).flush()
            return cast(list[str | None], pickle.load(cast(IO[bytes], self.proc.stdout)))
        except (OSError, EOFError, pickle.UnpicklingError):
            self.close()
            raise _Died(f"exit code {self.proc.returncode}") from None

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


def _decoded(paths: list[str], max_pixels: int, worker: _Worker) -> list[str | None]:
    """Each file's reason; when the worker dies on the chunk, its files one by one, each in a
    fresh worker: the one that kills it is named bad, and the rest are still checked."""
    try:
        return worker.decode(paths)
    except _Died as died:
        if len(paths) == 1:
            return [f"the decoder crashed on it ({died})"]
    reasons: list[str | None] = []
    for path in paths:
        alone = _Worker(max_pixels)
        reasons += _decoded([path], max_pixels, alone)
        alone.close()
    return reasons


def decode_all(
    paths: list[str], max_pixels: int, workers: int, *, desc: str, progress: bool
) -> list[str | None]:
    """Fully decode `paths` in `workers` worker interpreters: the reason each one fails, or None."""
    reasons: list[str | None] = [None] * len(paths)
    starts = iter(range(0, len(paths), CHUNK))
    lock, stop = threading.Lock(), threading.Event()

    def drive(bar: tqdm) -> None:  # one thread per worker: sends it chunks until none is left
        worker: _Worker | None = None
        try:
            while not stop.is_set():
                with lock:
                    start = next(starts, None)
                if start is None:
                    return
                if worker is None or worker.proc.returncode is not None:  # none yet, or it died
                    worker = _Worker(max_pixels)
                part = paths[start : start + CHUNK]
                reasons[start : start + len(part)] = _decoded(part, max_pixels, worker)
                bar.update(len(part))
        finally:
            if worker is not None:
                worker.close()

    count = max(1, min(workers, -(-len(paths) // CHUNK)))
    with tqdm(total=len(paths), unit="img", desc=desc, disable=not progress) as bar:
        with ThreadPoolExecutor(count) as pool:
            try:
                for done in [pool.submit(drive, bar) for _ in range(count)]:
                    done.result()
            except BaseException:  # Ctrl-C, or a worker that cannot start: the others stop too
                stop.set()
                raise
    return reasons


def serve() -> None:
    """A worker's loop: a pickled list of paths in, the list of their reasons out, until EOF."""
    from stallfree.data.readers.imageio import BadImageError, open_rgb

    max_pixels = int(sys.argv[1])
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
        answer: list[str | None] = []
        for path in paths:
            try:
                open_rgb(path, max_pixels)
                answer.append(None)
            except BadImageError as exc:
                answer.append(exc.reason)
        pickle.dump(answer, replies)
        replies.flush()
