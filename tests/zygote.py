"""A fork server for the tests' end-to-end runs: Python processes that start with torch,
torch._dynamo, numpy, PIL and DALI already imported.

Each `python -m stallfree ...` the suite starts paid seconds of imports before its first step
(torchrun more), most of the suite's time on 2 cores. This server imports those modules
once and forks a child per request; `tests/fastpython` (zygote_client.py) is the `python` the
tests start instead. stallfree itself is not imported here: each child imports it afresh, so its
module state and at-fork handlers are a new process's.

A child is its own session (setsid), gets the client's stdin, stdout and stderr, its working
directory, environment and arguments (`-m MODULE`, `-c CODE` or a script, after `-u`/`-W`), and
runs to the interpreter's own exit, atexit and thread joins included. The client forwards every
signal it gets to the child's process group and ends as the child ended; a client that dies
(SIGKILL, a test's timeout) takes the child's group with it.

Run: `python tests/zygote.py SOCKET` (conftest.py starts one per pytest process).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import types
import warnings
from collections.abc import Callable
from pathlib import Path

PRELOAD = (
    "numpy",
    "torch",
    "torch._dynamo",  # what torch.optim's first optimizer imports
    "torch.distributed.launcher.api",  # torchrun's, less torch.distributed.run: run as __main__
    "torch.utils.data",
    "PIL.Image",
    "tqdm",
    "obstore",
    "nvidia.dali.fn",
    "nvidia.dali.plugin.pytorch",
)


# A fresh interpreter's warning filters: this server starts without -W or PYTHONWARNINGS (see
# start), and what the preloaded modules add (sympy's, torch's) must not reach a child.
_FILTERS = list(warnings.filters)
_THREADS = {"default": 1}  # torch's intra-op thread count where OMP_NUM_THREADS is not set


def _preload() -> None:
    # torch reads OMP_NUM_THREADS once, at import: import it without, to learn its own default.
    saved = os.environ.pop("OMP_NUM_THREADS", None)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an extra not installed: a child imports what it needs
            pass
    torch = sys.modules.get("torch")
    if torch is not None:
        _THREADS["default"] = torch.get_num_threads()
    if saved is not None:
        os.environ["OMP_NUM_THREADS"] = saved


def _set_threads() -> None:
    """The thread count a fresh interpreter's torch would take from this child's environment
    (torchrun sets OMP_NUM_THREADS=1 per rank): summation order, hence the bits, depends on it."""
    torch = sys.modules.get("torch")
    wanted = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None:
        torch.set_num_threads(int(wanted) if wanted.isdigit() and int(wanted) > 0 else _THREADS["default"])


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """A client's request: an 8-byte length, then JSON; stdin, stdout, stderr ride along."""
    head, fds, _, _ = socket.recv_fds(conn, 8, 3)
    while len(head) < 8:
        head += conn.recv(8 - len(head))
    size, body = int(head), b""
    while len(body) < size:
        body += conn.recv(size - len(body))
    return json.loads(body), fds


_SERVER_ENV = dict(os.environ)


def _entries(env: dict[str, str]) -> list[str]:
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _shadows_a_loaded_module(env: dict[str, str]) -> bool:
    """Whether a path in `env`'s PYTHONPATH that this server lacks holds a module or package
    of a name imported here (a stub that hides nvidia.dali or optree from a test's run)."""
    for entry in set(_entries(env)) - set(_entries(_SERVER_ENV)):
        try:
            names = os.listdir(entry)
        except OSError:
            continue
        if any(name.split(".")[0] in sys.modules for name in names):
            return True
    return False


def _python_path(env: dict[str, str], base: list[str], first: str) -> list[str]:
    return [first, *_entries(env), *base]


def _run(argv: list[str], base: list[str]) -> None:
    """Run `python ARGV` in this (forked) process, as a fresh interpreter would."""
    args, cli = list(argv), []
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    while args and args[0] in ("-u", "-W") or (args and args[0].startswith("-W")):
        flag = args.pop(0)
        if flag == "-u":
            unbuffered = True
        else:
            cli.append(flag[2:] or args.pop(0))
    # An option this server does not mimic, or a path that may shadow a module imported here
    # (a test's stub that hides one): the real interpreter.
    if (
        _shadows_a_loaded_module(os.environ)
        or not args
        or (args[0].startswith("-") and args[0] not in ("-m", "-c"))
        or (not args[0].startswith("-") and not os.path.isfile(args[0]))  # a folder or zip to run
    ):
        os.execv(sys.executable, [sys.executable, *argv])
    if unbuffered:
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)  # type: ignore[union-attr]
    # As the interpreter orders them: PYTHONWARNINGS, then -W, the last added checked first.
    sys.warnoptions[:] = [w for w in os.environ.get("PYTHONWARNINGS", "").split(",") if w] + cli
    warnings.filters[:] = _FILTERS
    warnings._filters_mutated()  # type: ignore[attr-defined]  # noqa: SLF001 - filters replaced
    warnings._processoptions(sys.warnoptions)  # type: ignore[attr-defined]  # noqa: SLF001 - what -W does
    sys.excepthook = _without_this_server()
    importlib.invalidate_caches()
    # A new __main__ (-m runs in the current one's globals, which are this server's).
    main = sys.modules["__main__"] = types.ModuleType("__main__")
    if args[0] == "-m":
        sys.argv = ["-m", *args[2:]]
        sys.path[:] = _python_path(os.environ, base, os.getcwd())
        runpy._run_module_as_main(args[1])  # type: ignore[attr-defined]  # noqa: SLF001 - what -m does
        return
    if args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path[:] = _python_path(os.environ, base, "")
        code = compile(args[1], "<string>", "exec")
    else:  # a script: argv[0] as given, __file__ absolute, as the interpreter has them
        sys.argv = args
        sys.path[:] = _python_path(os.environ, base, os.path.dirname(os.path.realpath(args[0])))
        main.__file__ = os.path.abspath(args[0])
        with open(main.__file__, "rb") as source:
            code = compile(source.read(), main.__file__, "exec")
    exec(code, main.__dict__)


def _without_this_server() -> Callable[..., None]:
    """The default excepthook, less the frames of this server above the program's own: an
    uncaught exception's traceback reads as the interpreter's."""
    ours = __file__  # now: a -m program's globals may be this module's

    def hook(kind: type[BaseException], value: BaseException, tb: types.TracebackType | None) -> None:
        while tb is not None and tb.tb_frame.f_code.co_filename == ours:
            tb = tb.tb_next
        sys.__excepthook__(kind, value.with_traceback(tb), tb)  # printed from value.__traceback__

    return hook


def _start_child(request: dict, fds: list[int], closing: list[socket.socket], base: list[str]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    for sock in closing:
        sock.close()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _set_threads()
    _run(request["argv"], base)
    raise SystemExit(0)  # up through serve() to the interpreter's own exit


def serve(path: str) -> None:
    _preload()
    gc.freeze()  # children's collections leave the preloaded objects (and their pages) alone
    # Without this file's folder, and without PYTHONPATH's entries: a child's come from its own.
    base = [p for p in sys.path[1:] if p not in _entries(_SERVER_ENV)]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # a client never finds a socket that does not accept yet
    parent, clients = os.getppid(), {}  # client connection -> its child's pid
    waiting: dict[int, socket.socket] = {}
    started: dict[int, str] = {}
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    while os.getppid() == parent and not stopping:
        readable, _, _ = select.select([listener, *clients], [], [], 0.05)
        for sock in readable:
            if sock is listener:
                conn, _ = listener.accept()
                request, fds = _receive(conn)
                pid = _start_child(request, fds, [listener, conn, *clients], base)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                clients[conn], waiting[pid] = pid, conn
                started[pid] = request["env"].get("PYTEST_CURRENT_TEST", "")
            elif not sock.recv(1):  # the client is gone: so is its child, as a group kill would
                pid = clients.pop(sock)
                if waiting.pop(pid, None) is not None:
                    _kill_group(pid)
                sock.close()
        _reap(waiting, clients, started)
    for pid in waiting:
        _kill_group(pid)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _reap(
    waiting: dict[int, socket.socket], clients: dict[socket.socket, int], started: dict[int, str]
) -> None:
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        # Which test paid how much CPU in its processes (pytest names it in their environment).
        test, _, _ = started.pop(pid, "").partition(" (")
        print(f"{usage.ru_utime + usage.ru_stime:8.2f} CPU-s  {test}", flush=True)
        conn = waiting.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(json.dumps({"status": status}).encode() + b"\n")
            except OSError:
                pass
            clients.pop(conn, None)
            conn.close()


ZYGOTE_ENV = "STALLFREE_TEST_ZYGOTE"  # the server's socket, for the clients
NET_ENV = "STALLFREE_TEST_ZYGOTE_NET"  # its network namespace: a client in another runs the real Python
FASTPYTHON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fastpython")


def start(folder: Path) -> subprocess.Popen:
    """Start a server (its socket and log in `folder`) and point this process's children at it:
    `fastpython` finds it, and torchrun starts its ranks through it (PYTHON_EXEC)."""
    path = str(folder / "zygote.sock")
    logs = Path(os.environ.get("STALLFREE_TEST_ZYGOTE_LOGS", folder))  # kept after the session
    with open(logs / f"zygote-{os.getpid()}.log", "ab") as log:
        server = subprocess.Popen(
            [sys.executable, __file__, path],
            stdin=subprocess.DEVNULL,
            env={k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"},  # see _FILTERS
            stdout=log,
            stderr=log,
            start_new_session=True,  # a test's signal to its own group never reaches the server
            close_fds=True,
        )
    os.environ.update(
        {
            ZYGOTE_ENV: path,
            NET_ENV: os.readlink("/proc/self/ns/net"),
            "STALLFREE_TEST_PYTHON": sys.executable,
            "PYTHON_EXEC": FASTPYTHON,
        }
    )
    return server


def stop(server: subprocess.Popen) -> None:
    """Stop the server (its children still running are killed with it) and forget it."""
    server.terminate()
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
    for name in (ZYGOTE_ENV, NET_ENV, "PYTHON_EXEC"):
        os.environ.pop(name, None)


if __name__ == "__main__":
    serve(sys.argv[1])
