"""What the tests' cloud emulators share (tests/gcs_server.py, tests/azure_server.py): a free
loopback port, a server process in its own session stopped with its group, the standard
variables set for a session, and the skip (a failure under CI) where one cannot be installed."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import pytest

ROOT = Path(__file__).resolve().parents[1]


def unavailable(reason: str) -> NoReturn:
    """Skip with `reason` (the install command), or fail under CI, where every server must run."""
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range (32768-60999 by default): a port
    found free there could be given to some client's connection before the server binds it."""
    while True:
        port = random.randrange(23_000, 32_000)  # s3_server.py draws from 12000-22700
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


class Process:
    """One emulator process; `start()` waits until `ready()` says it answers, `kill()` ends it."""

    def __init__(self, cmd: list[str], data_dir: Path, ready: Callable[[], bool]) -> None:
        self.cmd, self.dir, self.ready = cmd, data_dir, ready
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        log_path = self.dir / "server.log"
        log = open(log_path, "ab")  # noqa: SIM115 (the child holds it)
        # Its own session, no inherited fds: a $(...) caller would otherwise wait on our pipes.
        self.proc = subprocess.Popen(
            self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.cmd[0]} exited with {self.proc.returncode}; see {log_path}")
            if self.ready():
                return
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"{self.cmd[0]} did not answer in {timeout} s; see {log_path}")

    def kill(self) -> None:
        """Kill its whole process group (node starts none, but a wrapper script might)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None


@contextmanager
def environment(env: Mapping[str, str]) -> Iterator[None]:
    """`env` set in this process (and the ones it starts) for the block, then restored."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
