"""The one base class of every error a user can cause; the CLI catches it once."""

from __future__ import annotations

# EX_TEMPFAIL from sysexits.h, "try again later": a preempted run, or one stopped by a store
# that stayed down. A scheduler wrapper (a requeue loop) goes round again on it.
PREEMPTED_EXIT_CODE = 75
# 128 + SIGINT, the shell's code for Ctrl-C: a requeue loop stops rather than going again.
INTERRUPTED_EXIT_CODE = 130


class StallfreeError(Exception):
    """A user-facing error: one line that names the file, key or value and the fix.

    The CLI prints it without a traceback and exits with `exit_code`.
    """

    exit_code = 2
    hint = ""  # a fix that applies to every error of the class; the CLI prints it after the message
    # A library's own words behind the error, whole: `--verbose` prints them, the message never.
    detail = ""
    # Every rank of a node meets it alike (a recipe, a backend's name or import): the node's
    # first rank alone says it.
    same_on_every_rank = False


class RunDirError(StallfreeError):
    """An output directory that cannot hold this run (another run's files, not writable)."""


class DeviceError(StallfreeError):
    """A requested device that this machine does not have."""


def some_of(items: list[str], shown: int = 3) -> str:
    """The first few of a long list for a one-line message, and how many more there are."""
    more = (
        f"; and {len(items) - shown} more (`stallfree data check` lists them all)"
        if len(items) > shown
        else ""
    )
    return "; ".join(items[:shown]) + more
