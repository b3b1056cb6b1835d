"""What stallfree prints: stdlib `logging` to stderr, rank 0 only, progress bars only on a TTY.

On a terminal a person watches a progress bar and plain `stallfree: ...` lines written above
it. Off a terminal (a batch job's `> log 2>&1`) there is no bar, whose carriage-return frames
would fill the log: every line is timestamped, one per log interval. Under torchrun or srun only
rank 0 speaks; the other ranks print their errors only, so nothing appears once per rank.
Warnings go through the same handler, as one line each. C libraries' bare lines on fd 2
(libpng's inside DALI) are routed through it too, while a DALI loader is open (NativeStderr).
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import sys
import threading
import warnings

from tqdm import tqdm

LOGGER = logging.getLogger("stallfree")
_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


class _Stderr(logging.Handler):
    """Writes each line to the current sys.stderr; on a terminal through tqdm, so that a line
    lands above a live progress bar instead of inside it."""

    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            if self.tty:
                tqdm.write(line, file=sys.stderr)
            else:
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging must never take the run down
            self.handleError(record)


def _one_line_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    # A warning is for the user: its text, not the source line that raised it.
    return f"warning: {message}"


def show_progress(requested: bool) -> bool:
    """Progress bars only when asked for and stderr is a terminal."""
    return requested and sys.stderr.isatty()


def setup_logging(rank: int = 0, verbose: bool = False) -> None:
    """Route stallfree's lines and Python warnings to stderr, for this process's rank
    (`verbose`: debug lines too)."""
    tty = sys.stderr.isatty()
    handler = _Stderr(tty)
    where = f"[rank {rank}] " if rank else ""
    stamp = "" if tty else "%(asctime)s "
    handler.setFormatter(logging.Formatter(f"{stamp}stallfree: {where}%(message)s", _TIME_FORMAT))
    warnings.formatwarning = _one_line_warning
    logging.captureWarnings(True)
    for logger in (LOGGER, logging.getLogger("py.warnings")):
        logger.handlers = [handler]
        logger.propagate = False
        # Rank 0 speaks for the job; every other rank only reports its own errors.
        logger.setLevel((logging.DEBUG if verbose else logging.INFO) if rank == 0 else logging.ERROR)


_LIBPNG = re.compile(rb"libpng warning: (.*?)\s*$")
_LINE_END = (b"\n", b"\r")


class NativeStderr:
    """While acquired, what C code writes to fd 2 goes through a pipe: libpng's bare warnings
    (inside DALI's decoder threads) become one log line per kind, everything else passes
    through unchanged, as it comes (progress frames without their newline too).

    Python's own sys.stderr, when it is fd 2, is pointed straight at the real stream, so that
    its lines (a traceback at a crash) never wait in the pipe. Reference counted: every DALI
    loader acquires it and releases it in close(); an exit with it held restores fd 2.
    """

    def __init__(self) -> None:
        self.users = 0
        self.seen: set[str] = set()
        self._lock = threading.Lock()
        self._saved = -1
        self._thread: threading.Thread | None = None
        self._python: tuple[object, object] | None = None  # (the original sys.stderr, ours)
        atexit.register(self._at_exit)

    def acquire(self) -> None:
        """Start routing fd 2 (the first user)."""
        with self._lock:
            self.users += 1
            if self.users == 1:
                self._start()

    def release(self) -> None:
        """Stop routing when the last user is done; pending lines are forwarded first."""
        with self._lock:
            self.users = max(0, self.users - 1)
            if self.users == 0 and self._saved >= 0:
                self._stop()

    def _start(self) -> None:
        sys.stderr.flush()
        self._saved = os.dup(2)
        read, write = os.pipe()
        self._thread = threading.Thread(
            target=self._pump, args=(read, os.dup(self._saved)), name="stallfree-stderr", daemon=True
        )
        self._thread.start()
        os.dup2(write, 2)
        os.close(write)
        if _is_fd2(sys.stderr):
            ours = os.fdopen(os.dup(self._saved), "w", buffering=1, errors="backslashreplace")
            self._python, sys.stderr = (sys.stderr, ours), ours

    def _stop(self) -> None:
        if self._python is not None:
            original, ours = self._python
            if sys.stderr is ours:
                sys.stderr = original
            ours.close()  # type: ignore[attr-defined]
            self._python = None
        sys.stderr.flush()
        os.dup2(self._saved, 2)  # the pipe's last write end closes: the reader drains and ends
        os.close(self._saved)
        self._saved = -1
        if self._thread is not None:
            # A child process that inherited the pipe keeps it open: do not wait for it.
            self._thread.join(timeout=2)

    def _at_exit(self) -> None:
        with self._lock:
            if self._saved >= 0:
                self.users = 0
                self._stop()

    def _pump(self, read: int, out: int) -> None:
        pending, passing = b"", False  # the current line while it may be libpng's; or not
        try:
            while chunk := os.read(read, 65536):
                for piece in chunk.splitlines(keepends=True):
                    if passing:
                        os.write(out, piece)
                        passing = not piece.endswith(_LINE_END)
                        continue
                    pending += piece
                    if pending.endswith(_LINE_END):
                        self._line(pending, out)
                        pending = b""
                    elif not (pending.startswith(b"libpng") or b"libpng".startswith(pending)):
                        os.write(out, pending)
                        pending, passing = b"", True
            if pending:
                os.write(out, pending)
        finally:
            os.close(read)
            os.close(out)

    def _line(self, line: bytes, out: int) -> None:
        found = _LIBPNG.match(line)
        if found is None:
            os.write(out, line)
            return
        kind = found.group(1).decode(errors="replace")
        if kind not in self.seen:  # libpng says it per file, DALI once more per decode
            self.seen.add(kind)
            LOGGER.warning(
                f"libpng (DALI's PNG decoder) warned: {kind}; a PNG's metadata is "
                "malformed and was ignored, its pixels decode (said once per kind)"
            )


def _is_fd2(stream: object) -> bool:
    try:
        return stream.fileno() == 2  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return False


NATIVE_STDERR = NativeStderr()
