"""What stallfree prints: stdlib `logging` to stderr, rank 0 only, progress bars only on a TTY.

On a terminal a person watches a progress bar and plain `stallfree: ...` lines written above
it. Off a terminal (a batch job's `> log 2>&1`) there is no bar, whose carriage-return frames
would fill the log: every line is timestamped, one per log interval. Under torchrun or srun only
rank 0 speaks; the other ranks print their errors only, so nothing appears once per rank.
Warnings go through the same handler, as one line each.
"""

from __future__ import annotations

import logging
import sys
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


def _one_line_warning(message: Warning | str, category: type[Warning], filename: str,
                      lineno: int, line: str | None = None) -> str:
    # A warning is for the user: its text, not the source line that raised it.
    return f"warning: {message}"


def show_progress(requested: bool) -> bool:
    """Progress bars only when asked for and stderr is a terminal."""
    return requested and sys.stderr.isatty()


def setup_logging(rank: int = 0) -> None:
    """Route stallfree's lines and Python warnings to stderr, for this process's rank."""
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
        logger.setLevel(logging.INFO if rank == 0 else logging.ERROR)
