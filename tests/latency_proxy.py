"""A TCP proxy on loopback that delays each request by D ms: an object store's latency, at will.

Each client connection gets its own connection to the upstream server. A chunk from the client
that starts a request (the connection's first, or the first after the server has answered) waits
D ms before it is forwarded; the rest of a request (a PUT's body) and every answer pass at once.
HTTP/1.1 without pipelining (botocore's way) has one request in flight per connection, so this is
D ms added to every request, as many at a time as the client has connections open.

Used by tests/e2e/test_latency_proxy.py (in a thread) and benchmarks/s3_latency.py (as a process of
its own, so that its event loop does not take the measured process's GIL):

    python tests/latency_proxy.py --upstream http://127.0.0.1:8333 --delay-ms 10
    # prints "listening http://127.0.0.1:PORT" once ready, then serves until killed
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import threading
from urllib.parse import urlsplit

CHUNK = 1 << 16


class LatencyProxy:
    """Forward 127.0.0.1:`port` (0: a free one) to `upstream` ("host:port" or an http:// URL),
    each request `delay_ms` late. `start()` serves from a daemon thread; `serve()` in the caller's
    loop; `endpoint` is the URL to point AWS_ENDPOINT_URL at."""

    def __init__(self, upstream: str, delay_ms: float, port: int = 0) -> None:
        parts = urlsplit(upstream if "//" in upstream else f"//{upstream}")
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.delay = delay_ms / 1000
        self.port = port
        self.requests = 0  # requests delayed so far
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._ready = threading.Event()

    @property
    def endpoint(self) -> str:
        """The proxy's URL."""
        return f"http://127.0.0.1:{self.port}"

    async def serve(self) -> None:
        """Listen, then serve until cancelled."""
        self._loop = asyncio.get_running_loop()
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        async with self._server:
            try:
                await self._server.serve_forever()
            except asyncio.CancelledError:  # stop(): the server was closed
                pass

    def start(self) -> LatencyProxy:
        """Serve from a daemon thread; return once listening."""
        threading.Thread(target=asyncio.run, args=(self.serve(),), daemon=True, name="latency-proxy").start()
        if not self._ready.wait(10):
            raise RuntimeError("the latency proxy did not start")
        return self

    def stop(self) -> None:
        """Stop listening (a thread started by `start()` then ends)."""
        if self._loop is not None and self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)

    async def _connection(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        try:
            server_in, server_out = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_out.close()
            return
        # Set when the server has sent something since the client's last chunk: the client's
        # next chunk starts a new request.
        answered = asyncio.Event()
        answered.set()
        try:
            await asyncio.gather(
                self._pump(client_in, server_out, before=self._delayed(answered)),
                self._pump(server_in, client_out, before=_setter(answered)),
                return_exceptions=True,
            )
        except asyncio.CancelledError:  # stop() with connections open: end them quietly
            server_out.close()
            client_out.close()

    def _delayed(self, answered: asyncio.Event):
        async def before() -> None:
            if answered.is_set():  # a new request: the store's latency
                answered.clear()
                self.requests += 1
                await asyncio.sleep(self.delay)

        return before

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, before) -> None:
        try:
            while chunk := await reader.read(CHUNK):
                await before()
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()


def _setter(event: asyncio.Event):
    async def before() -> None:
        event.set()

    return before


def start_process(upstream: str, delay_ms: float) -> tuple[subprocess.Popen[str], str]:
    """This proxy in a process of its own session (a benchmark's: it then takes no CPU from the
    measured process's GIL); (the process, its endpoint)."""
    cmd = [sys.executable, __file__, "--upstream", upstream, "--delay-ms", str(delay_ms)]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    if line[:1] != ["listening"]:
        proc.kill()
        raise RuntimeError(f"the latency proxy did not start: {line}")
    return proc, line[1]


def main() -> None:
    """Serve until killed; print the URL once listening (a parent waits for that line)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="host:port or http://host:port")
    parser.add_argument("--delay-ms", type=float, required=True)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    proxy = LatencyProxy(args.upstream, args.delay_ms, args.port)

    async def run() -> None:
        task = asyncio.create_task(proxy.serve())
        await asyncio.get_running_loop().run_in_executor(None, proxy._ready.wait)  # noqa: SLF001
        print(f"listening {proxy.endpoint}", flush=True)
        await task

    asyncio.run(run())


if __name__ == "__main__":
    main()
