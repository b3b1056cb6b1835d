"""`python ARGS` through the tests' fork server (zygote.py): started as `tests/fastpython`.

It hands its arguments, working directory, environment, stdin, stdout and stderr to the server,
forwards every signal it gets to the child's process group, and ends as the child did (its exit
code, or killed by the same signal). Where no server answers, it runs the real interpreter.
Standard library only, run with -S: it starts in milliseconds.
"""

import json
import os
import signal
import socket
import sys
import time

FORWARDED = (
    signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
    signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGCONT,
)  # fmt: skip


def _connect(path: str) -> socket.socket | None:
    deadline = time.monotonic() + 60  # the server may still be importing torch
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except FileNotFoundError:
            sock.close()
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        except OSError:  # refused: the server is gone
            sock.close()
            return None


def main() -> None:
    args = sys.argv[1:]
    real = os.environ.get("STALLFREE_TEST_PYTHON") or sys.executable
    path = os.environ.get("STALLFREE_TEST_ZYGOTE")
    # In another network namespace (`ip netns exec`), the server's children would not be.
    here = os.environ.get("STALLFREE_TEST_ZYGOTE_NET") == os.readlink("/proc/self/ns/net")
    sock = _connect(path) if path and here else None
    if sock is None:
        os.execv(real, [real, *args])
    # Held until the child's pid is known and `forward` installed: the child may print (and its
    # test signal this client) before then, and a signal this client handled itself would end it.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    body = json.dumps({"argv": args, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    socket.send_fds(sock, [b"%08d" % len(body)], [0, 1, 2])
    sock.sendall(body)
    replies = sock.makefile("r")
    pid = json.loads(replies.readline())["pid"]

    def forward(signum: int, frame: object) -> None:
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    line = replies.readline()
    if not line:
        sys.stderr.write("zygote_client: the fork server went away\n")
        os._exit(70)
    status = json.loads(line)["status"]
    if os.WIFSIGNALED(status):  # end by the same signal, so the parent sees what it would have
        signum = os.WTERMSIG(status)
        if signum != signal.SIGKILL:
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os._exit(os.waitstatus_to_exitcode(status))


main()
