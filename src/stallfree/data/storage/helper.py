"""A main process's store helper: a process started fresh (not forked) that makes the main
process's requests (listings, HEADs, start-up checks) for it, so that the main process never
starts obstore's runtime and the DataLoader workers it forks later can read directly (see
wire.py). Requests travel as pickles over its stdin and stdout, many in flight at once.

`main` is the helper's side; `request` the caller's.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any

import stallfree.data.storage.settings as settings
import stallfree.data.storage.wire as wire
from stallfree.data.storage.failures import StoreError

_HEAD = struct.Struct("!Q")
_lock = threading.Lock()
_helpers: dict[tuple[int, str], _Helper] = {}


def _send(out: IO[bytes], message: Any, lock: threading.Lock) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    with lock:
        out.write(_HEAD.pack(len(data)) + data)
        out.flush()


def _receive(source: IO[bytes]) -> Any:
    head = source.read(_HEAD.size)
    if len(head) < _HEAD.size:
        return None
    (size,) = _HEAD.unpack(head)
    return pickle.loads(source.read(size))


class _Helper:
    """The helper process of one caller process, with the answers it owes."""

    def __init__(self) -> None:
        env = dict(os.environ, **{wire.HELPER_ENV: "1"})
        self.proc = subprocess.Popen(
            # Not `-m`: the package imports this module first, which runpy warns about.
            [sys.executable, "-c", "from stallfree.data.storage.helper import main; main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
        )
        self.pending: dict[int, Future[Any]] = {}
        self.next_id = 0
        self.write_lock = threading.Lock()
        self.alive = True
        self.pid = os.getpid()
        threading.Thread(target=self._answers, name="stallfree-store-helper", daemon=True).start()

    def _answers(self) -> None:
        assert self.proc.stdout is not None
        while (message := _receive(self.proc.stdout)) is not None:
            ident, ok, value = message
            future = self.pending.pop(ident, None)
            if future is not None:
                future.set_result(value) if ok else future.set_exception(value)
        self.alive = False
        for future in list(self.pending.values()):
            future.set_exception(wire.Failure("helper", "the store helper process exited"))
        self.pending.clear()

    def close(self) -> None:
        """Let the helper end (it exits when its stdin closes) once its answers are in."""
        if self.proc.stdin is not None and self.pid == os.getpid():
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def request(self, op: str, where: tuple[str, str, str, float], args: tuple[Any, ...]) -> Any:
        future: Future[Any] = Future()
        with self.write_lock:
            ident, self.next_id = self.next_id, self.next_id + 1
            self.pending[ident] = future
        assert self.proc.stdin is not None
        try:
            _send(self.proc.stdin, (ident, op, where, args), self.write_lock)
        except OSError:
            self.pending.pop(ident, None)
            self.alive = False
            raise wire.Failure("helper", "the store helper process exited") from None
        return future.result()


def request(op: str, where: tuple[str, str, str, float], *args: Any) -> Any:
    """Have this process's helper (started on first use) make the request; Failure on failure."""
    # One a process and store environment: the helper reads the variables it started with.
    key = (os.getpid(), settings.store_environment())
    with _lock:
        helper = _helpers.get(key)
        if helper is None or not helper.alive:
            for old in _helpers.values():  # a parent's (never used here), or another environment's
                old.close()
            _helpers.clear()
            helper = _helpers[key] = _Helper()
    return helper.request(op, where, args)


def main() -> None:
    """The helper's side: answer requests until the caller closes our stdin."""
    source, out = sys.stdin.buffer, sys.stdout.buffer
    write_lock = threading.Lock()

    def answer(ident: int, op: str, where: tuple[str, str, str, float], args: tuple[Any, ...]) -> None:
        try:
            reply = (ident, True, wire.call(op, where, *args))
        except (wire.Failure, StoreError) as failure:
            reply = (ident, False, failure)
        except Exception as exc:  # noqa: BLE001 - the caller names it; the helper goes on
            reply = (ident, False, wire.Failure("invalid", f"{type(exc).__name__}: {exc}"))
        try:
            _send(out, reply, write_lock)
        except OSError:
            os._exit(0)  # the caller is gone

    with ThreadPoolExecutor(64, thread_name_prefix="stallfree-helper") as pool:
        while (message := _receive(source)) is not None:
            pool.submit(answer, *message)
    os._exit(0)  # without tearing obstore's runtime down
