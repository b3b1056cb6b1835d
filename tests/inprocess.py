"""`stallfree ARGS` in this process: the `cli` fixture's runner (conftest.py).

A command test's subject is what the command says, writes and exits with, not the process:
calling `stallfree.cli.main` here saves the process's start and keeps a traceback a traceback.
What a run changes in the process (its log handlers, the warnings hook, SIGUSR1's handler, the
environment, torch's thread count) is put back when the test ends, so tests do not see each other.
"""

from __future__ import annotations

import logging
import os
import signal
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch


@dataclass(frozen=True)
class Result:
    """What `stallfree ARGS` ended with: its exit code and what it wrote to stdout and stderr."""

    code: int
    out: str
    err: str

    def errors(self) -> list[str]:
        """The `stallfree: error:` lines of stderr (a user error is exactly one)."""
        return [line for line in self.err.splitlines() if "stallfree: error:" in line]


class Cli:
    """Calls the console script's entry as the process would (`raise SystemExit(main())`)."""

    def __init__(self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
        self.capsys, self.monkeypatch = capsys, monkeypatch
        self._environ = dict(os.environ)
        self._threads = torch.get_num_threads()
        self._usr1 = signal.getsignal(signal.SIGUSR1)
        for name in ("stallfree", "py.warnings"):
            logger = logging.getLogger(name)
            for attr in ("handlers", "level", "propagate"):
                monkeypatch.setattr(logger, attr, getattr(logger, attr))
        monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
        monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
        # logging.captureWarnings(True) hooks warnings only while this is None: put back, the
        # next run hooks them again, as a fresh process would.
        saved = logging._warnings_showwarning  # type: ignore[attr-defined]  # noqa: SLF001
        monkeypatch.setattr(logging, "_warnings_showwarning", saved)

    def __call__(self, *args: str | Path) -> Result:
        from stallfree.cli import main

        self.capsys.readouterr()  # what the test printed before is not the command's
        try:
            code: int | str | None = main([str(a) for a in args])
        except SystemExit as exc:  # argparse's usage errors, --help, --version
            code = exc.code
        out, err = self.capsys.readouterr()
        if isinstance(code, str):  # as the interpreter does with `SystemExit("text")`
            err, code = err + code + "\n", 1
        return Result(0 if code is None else code, out, err)

    def restore(self) -> None:
        """Put back the environment, torch's threads and SIGUSR1 as they were before."""
        for key in set(os.environ) - set(self._environ):
            del os.environ[key]
        for key, value in self._environ.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
        torch.set_num_threads(self._threads)
        signal.signal(signal.SIGUSR1, self._usr1)
